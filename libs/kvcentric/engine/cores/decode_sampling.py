"""The next token of every sequence of a decode step from the step's logits: the plain greedy rows by one argmax
over all of them, the others one at a time through `sampling.choose` (the same tokens either way), with each
guided sequence's token mask; it schedules nothing and keeps no state but the grammar states of `Guides`.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvcentric.core.migration import history
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.guided import Guides
from kvcentric.engine.model.sampling import choose, plain_greedy


class BatchSampler:
    def __init__(self, guides: Guides, eos_token_ids: Collection[int]) -> None:
        self.guides, self.eos_token_ids = guides, eos_token_ids

    def choose_all(self, logits: torch.Tensor, batch: list[DecodeRequest]) -> list[int]:
        """The next token of every row, in the batch's order; each request's logprobs go in `next_logprob`."""
        plain = [row for row, request in enumerate(batch) if plain_greedy(request.job.sampling)]
        tokens: list[int] = [0] * len(batch)
        if plain:
            picked = (logits if len(plain) == len(batch) else logits[plain]).argmax(dim=-1).tolist()
            for row, token in zip(plain, picked):
                tokens[row] = token
                batch[row].next_logprob = None
        if len(plain) < len(batch):
            chosen = set(plain)
            for row, request in enumerate(batch):
                if row not in chosen:
                    tokens[row] = self.choose(logits[row], request)
        return tokens

    def choose(self, logits: torch.Tensor, request: DecodeRequest) -> int:
        """One sequence's next token from its row of logits, as its sampling parameters and history ask."""
        sampling = request.job.sampling
        prompt, output = history(sampling, request.prompt, request.generated)
        token, request.next_logprob = choose(logits, sampling, len(output), prompt, output, self.eos_token_ids,
                                             request.index, self.guides.mask(request.key, sampling, output))
        return token
