"""When a sequence stops: EOS, a stop token, or max_tokens. Pure."""

from __future__ import annotations

from kvcentric.protocol import SamplingParams


def finish_reason(token: int, num_generated: int, params: SamplingParams, eos_token_id: int) -> str | None:
    """'stop' or 'length' when the sequence that just produced `token` is done, else None."""
    if token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
