"""When a sequence stops: EOS, a stop token, or max_tokens. Pure."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from kvcentric.core.protocol import SamplingParams


def finish_reason(token: int, num_generated: int, params: SamplingParams,
                  eos_token_id: int | Collection[int]) -> Literal["stop", "length"] | None:
    """'stop' or 'length' when the sequence that just produced `token` is done, else None. `eos_token_id`:
    the model's end-of-sequence id, or all of them (ModelConfig.eos_token_ids)."""
    is_eos = token == eos_token_id if isinstance(eos_token_id, int) else token in eos_token_id
    if token in params.stop_token_ids or (is_eos and not params.ignore_eos):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
