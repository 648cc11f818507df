"""One sequence a decode instance generates: its job, where it is in its lifecycle (waiting for KV, receiving it,
running, preempted), its blocks, its tokens, and the token chunks it sends; it decides nothing (`decode.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvcentric.core.kept_kv import ReceivedKV
from kvcentric.core.protocol import DecodeJob, TokenChunk, TokenLogprob

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclasses.dataclass
class DecodeRequest:
    job: DecodeJob
    deadline: float
    state: Literal["waiting_kv", "receiving", "running", "preempted"] = "waiting_kv"
    blocks: list[int] = dataclasses.field(default_factory=list)
    prompt: list[int] = dataclasses.field(default_factory=list)
    layer_tokens: list[int] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    seq: int = 0
    recompute: bool = False
    """Resumed after preemption: its KV must be recomputed before the next step."""
    next_logprob: TokenLogprob | None = None
    """The logprobs of the token the step in flight chose (when the request asked for them)."""
    index: int = 0
    """Which of the request's `sampling.n` sequences this is (its choice index)."""
    staged: list[tuple[int, int, int, bytes, bytes]] | None = None
    """Its prompt KV in host memory (layer, start, end, key, value), waiting for blocks; None: on the device."""
    staged_bytes: int = 0
    """Host staging bytes reserved for it."""
    pool_addr: str = ""
    """The messenger whose pool takes the blocks its generated tokens fill (the prefill's, named in the push)."""
    received: ReceivedKV | None = None
    """While its KV arrives: which of its prompt's tokens arrived in every layer (what a broken push leaves)."""

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def key(self) -> str:
        """Its key among the engine's requests: the request id, and `<id>#<index>` for sequences after the first."""
        return self.job.request_id if self.index == 0 else f"{self.job.request_id}#{self.index}"

    @property
    def position(self) -> int:
        """Position of the last generated token, the one the next step feeds in."""
        return self.job.n_prompt_tokens + len(self.generated) - 1

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV the next decode step reads: the prompt and every token generated."""
        return self.job.n_prompt_tokens + max(1, len(self.generated))

    def chunk(self, token_ids: list[int], reason: FinishReason | None = None, error: str = "",
              error_status: int = 500, logprobs: list[TokenLogprob] | None = None,
              prompt_logprobs: list[TokenLogprob] | None = None) -> TokenChunk:
        self.seq += 1
        return TokenChunk(request_id=self.request_id, seq=self.seq - 1, token_ids=token_ids, finish_reason=reason,
                          prompt_tokens=self.job.n_prompt_tokens, completion_tokens=len(self.generated),
                          error=error, error_status=error_status, logprobs=logprobs or [],
                          prompt_logprobs=prompt_logprobs or [], index=self.index)
