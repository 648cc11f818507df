"""The next token of every sequence of a decode step from the step's logits: the plain greedy rows by one argmax
over all of them, the others one at a time through `sampling.choose` (the same tokens either way), with each
guided sequence's token mask, the batch's masks computed together (`start`: on a worker thread while the step's
forward pass runs, where it leaves the CPU free); it schedules nothing and keeps no state but the grammar states
of `Guides`.
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import Future

import torch

from kvcentric.core.migration import history
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.guided import BatchMasks, GuideRow, Guides
from kvcentric.engine.model.sampling import choose, plain_greedy, refused_logit

Masks = Future[BatchMasks]
"""The masks of a step's rows (None for a row not guided), being computed by `BatchSampler.start`."""


class BatchSampler:
    def __init__(self, guides: Guides, eos_token_ids: Collection[int]) -> None:
        self.guides, self.eos_token_ids = guides, eos_token_ids

    def start(self, batch: list[DecodeRequest]) -> Masks | None:
        """Begin the masks of the batch's guided rows on the guides' worker thread, to be computed while the
        step's forward pass runs (a row's mask depends only on its output so far); None when none is guided, or
        where the guides do not overlap the forward (on the CPU: `choose_all` computes them after it). Give the
        result to `choose_all`, which waits for it."""
        return self.guides.start([guide_row(request) for request in batch]) if self.guides.overlap else None

    def choose_all(self, logits: torch.Tensor, batch: list[DecodeRequest], masks: Masks | None = None) -> list[int]:
        """The next token of every row, in the batch's order; each request's logprobs go in `next_logprob`.
        `masks`: the batch's masks begun by `start` (without them, they are computed here, all together)."""
        plain = [row for row, request in enumerate(batch) if plain_greedy(request.job.sampling)]
        tokens: list[int] = [0] * len(batch)
        if plain:
            picked = (logits if len(plain) == len(batch) else logits[plain]).argmax(dim=-1).tolist()
            for row, token in zip(plain, picked):
                tokens[row] = token
                batch[row].next_logprob = None
        if len(plain) < len(batch):
            allowed = masks.result() if masks is not None else self.guides.masks([guide_row(r) for r in batch])
            forced = {row: token for row, token in allowed.forced.items() if takes_forced(batch[row])}
            chosen, premasked = set(plain), self.premasked(logits, batch, allowed, skip=forced)
            for row, request in enumerate(batch):
                if row in forced:  # what a draw under this mask returns, whatever the logits and the seed
                    tokens[row], request.next_logprob = forced[row], None
                elif row in premasked:
                    tokens[row] = self.masked(premasked[row], request, None)
                elif row not in chosen:
                    tokens[row] = self.masked(logits[row], request, allowed[row])
        return tokens

    @staticmethod
    def premasked(logits: torch.Tensor, batch: list[DecodeRequest], allowed: BatchMasks,
                  skip: Collection[int] = ()) -> dict[int, torch.Tensor]:
        """Row -> its float32 logits with its grammar's mask applied (-inf where refused), for the guided rows
        that ask for no logprobs (raw logprobs read the unmasked row), all in one op: what `adjust` does to each
        row alone. Empty for fewer than two such rows (one goes through `adjust`, as cheap). `skip`: rows whose
        token is chosen otherwise."""
        rows, masks = allowed.rows, allowed.allowed
        if masks is None:
            return {}
        slots = [slot for slot, row in enumerate(rows) if batch[row].job.sampling.logprobs is None and row not in skip]
        if len(slots) < len(rows):
            rows, masks = [rows[slot] for slot in slots], masks[slots]
        if len(rows) < 2:
            return {}
        chosen = logits if len(rows) == len(logits) else logits[torch.tensor(rows, device=logits.device)]
        if chosen.dtype != torch.float32:  # (a torch call costs even where it has nothing to do)
            chosen = chosen.float()
        if masks.device != chosen.device:
            masks = masks.to(chosen.device)
        return dict(zip(rows, torch.where(masks, chosen, refused_logit(chosen.device)).unbind()))

    def choose(self, logits: torch.Tensor, request: DecodeRequest) -> int:
        """One sequence's next token from its row of logits, as its sampling parameters and history ask."""
        return self.masked(logits, request, self.guides.masks([guide_row(request)])[0])

    def masked(self, logits: torch.Tensor, request: DecodeRequest, allowed: torch.Tensor | None) -> int:
        """`choose` with the sequence's grammar's mask given (`allowed`; None: not guided)."""
        sampling = request.job.sampling
        prompt, output = history(sampling, request.prompt, request.generated)
        token, request.next_logprob = choose(logits, sampling, len(output), prompt, output, self.eos_token_ids,
                                             request.index, allowed)
        return token


def takes_forced(request: DecodeRequest) -> bool:
    """A guided row whose mask allows one token takes it without a draw: every draw under the mask returns it
    (greedy or not, any top-k or top-p, any seed; a bias or a penalty moves its logit but leaves it the only finite
    one), unless the row asks for logprobs (computed from the logits) or min_tokens still holds back stop tokens
    (which `adjust` refuses as well, leaving it nothing: that case stays `choose`'s)."""
    sampling = request.job.sampling
    return sampling.logprobs is None and len(history(sampling, request.prompt, request.generated)[1]) >= \
        sampling.min_tokens


def guide_row(request: DecodeRequest) -> GuideRow | None:
    """The request's row for `Guides.masks`: its key, grammar and output so far (None when not guided)."""
    sampling = request.job.sampling
    return (request.key, sampling.guide, history(sampling, request.prompt, request.generated)[1]) if sampling.guide \
        else None
