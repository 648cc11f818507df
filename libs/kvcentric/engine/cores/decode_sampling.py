"""The next token of every sequence of a decode step from the step's logits: the plain greedy rows by one argmax
over all of them, the rows that ask for no logprobs adjusted one by one and drawn together (`sampling.draw_rows`),
the rest one at a time through `sampling.choose` (the same tokens every way), with each guided sequence's token
mask, the batch's masks computed together (`start`: on a worker thread while the step's forward pass runs, where it
leaves the CPU free); it schedules nothing and keeps no state but the grammar states of `Guides`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from kvcentric.core.migration import history
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.guided import BatchMasks, GuideRow, Guides
from kvcentric.engine.model.sampling import adjust, adjusts, choose, draw_rows, plain_greedy, refused_logit

if TYPE_CHECKING:
    from kvcentric.engine.model.kernels import CpuMasks
    from kvcentric.engine.model.runner import ModelRunner

Masks = Future[BatchMasks]
"""The masks of a step's rows (None for a row not guided), being computed by `BatchSampler.start`."""


class BatchSampler:
    def __init__(self, guides: Guides, eos_token_ids: Collection[int], cpu_masks: CpuMasks | None = None) -> None:
        """`cpu_masks`: the C++ op that applies a block's packed grammar masks to fp32 CPU logits in one call (None:
        torch's ops)."""
        self.guides, self.eos_token_ids, self.cpu_masks = guides, eos_token_ids, cpu_masks

    def start(self, batch: list[DecodeRequest]) -> Masks | None:
        """Begin the masks of the batch's guided rows on the guides' worker thread, to be computed while the
        step's forward pass runs (a row's mask depends only on its output so far); None when none is guided, or
        where the guides do not overlap the forward (on the CPU: `choose_all` computes them after it). Give the
        result to `choose_all`, which waits for it."""
        return self.guides.start([guide_row(request) for request in batch], find_forced(batch)) \
            if self.guides.overlap else None

    def choose_all(self, logits: torch.Tensor, batch: list[DecodeRequest], masks: Masks | None = None) -> list[int]:
        """The next token of every row, in the batch's order; each request's logprobs go in `next_logprob`.
        `masks`: the batch's masks begun by `start` (without them, they are computed here, all together). The rows
        of `logits` it draws may be left masked (-inf where a grammar refuses): they are the step's, read once."""
        plain = [row for row, request in enumerate(batch) if plain_greedy(request.job.sampling)]
        tokens: list[int] = [0] * len(batch)
        if plain:
            picked = (logits if len(plain) == len(batch) else logits[plain]).argmax(dim=-1).tolist()
            for row, token in zip(plain, picked):
                tokens[row] = token
                batch[row].next_logprob = None
        if len(plain) == len(batch):
            return tokens
        allowed = masks.result() if masks is not None else self.guides.masks([guide_row(r) for r in batch],
                                                                             find_forced(batch))
        chosen = set(plain)
        drawn: list[int] = []  # the rows drawn together: no logprobs asked
        for row, request in enumerate(batch):
            if row in chosen:
                continue
            if row in allowed.forced and takes_forced(request):  # what a draw under this mask returns, whatever
                tokens[row], request.next_logprob = allowed.forced[row], None  # the logits and the seed
            elif request.job.sampling.logprobs is not None:
                tokens[row] = self.masked(logits[row], request, allowed[row])
            else:
                drawn.append(row)
                request.next_logprob = None
        if drawn:
            for row, token in zip(drawn, self.draw_together(logits, [batch[row] for row in drawn], drawn, allowed)):
                tokens[row] = token
        return tokens

    def draw_together(self, logits: torch.Tensor, requests: list[DecodeRequest], rows: list[int],
                      allowed: BatchMasks) -> list[int]:
        """The tokens of `requests` (at `rows` of the batch), what `masked` gives each, in a few ops for them all:
        their float32 logits taken at once, their grammars' masks applied in one op (-inf where refused), the rest of
        `adjust` on the rows it changes (min_tokens, a bias, a penalty), and one `draw_rows`. On the CPU the masks
        are written into `logits`' rows in place (a step's logits are read once; a copy costs 15 us of a decode
        step: docs/performance-notebook.md)."""
        block = logits if len(rows) == len(logits) else logits[torch.tensor(rows, device=logits.device)]
        if block.dtype != torch.float32:  # (a torch call costs even where it has nothing to do)
            block = block.float()
        if self.cpu_masks is not None and allowed.words_per_row and self.cpu_masks.takes(block):
            if rows == allowed.rows:  # (every row drawn is guided, in the bitmask's order: a decode batch's way)
                self.cpu_masks.refuse(block, allowed.address, allowed.words_per_row, None)
            else:
                slots = [allowed.slots().get(row, -1) for row in rows]
                if any(slot >= 0 for slot in slots):
                    self.cpu_masks.refuse(block, allowed.address, allowed.words_per_row,
                                          (ctypes.c_int64 * len(slots))(*slots))
        else:
            mask = self.block_mask(rows, allowed, block.device)
            if mask is not None:
                block = torch.where(mask, block, refused_logit(block.device))
        steps = []
        for slot, request in enumerate(requests):
            sampling = request.job.sampling
            prompt, output = history(sampling, request.prompt, request.generated)
            steps.append(len(output))
            if adjusts(sampling, len(output)):
                if block is logits:  # (the caller's)
                    block = block.clone()
                block[slot] = adjust(block[slot], sampling, prompt, output, self.eos_token_ids)
        return draw_rows(block, [request.job.sampling for request in requests], steps,
                         [request.index for request in requests])

    @staticmethod
    def block_mask(rows: list[int], allowed: BatchMasks, device: torch.device) -> torch.Tensor | None:
        """The grammars' masks of `rows` as one bool block, a row each (every token allowed where a row is not
        guided); None where none of them is."""
        if allowed.allowed is None:
            return None
        slots = allowed.slots()
        guided = [(index, slots[row]) for index, row in enumerate(rows) if row in slots]
        if not guided:
            return None
        if len(guided) == len(rows) and len(rows) == len(allowed.rows):
            mask = allowed.allowed
        elif len(guided) == len(rows):
            mask = allowed.allowed[[slot for _, slot in guided]]
        else:
            mask = torch.ones(len(rows), allowed.allowed.shape[1], dtype=torch.bool)
            mask[[index for index, _ in guided]] = allowed.allowed[[slot for _, slot in guided]]
        return mask if mask.device == device else mask.to(device)

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


def find_forced(batch: list[DecodeRequest]) -> bool:
    """Whether the rows whose mask allows one token are worth finding: where one row alone is to be drawn, so that
    finding it forced saves the step's whole draw (a tenth of a `tiny` step at batch 1); with more, the others are
    drawn anyway, and a forced row among them costs the draw nothing but the search costs a few array calls
    (3 points of a `tiny` step at batch 8: docs/performance-notebook.md)."""
    return sum(not plain_greedy(request.job.sampling) for request in batch) == 1


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


def cpu_masks(runner: ModelRunner) -> CpuMasks | None:
    """The grammar-mask op of the runner's CPU kernels (`kernels.CpuMasks`), or None: a runner off the CPU, or one
    that runs torch's attention (no kernels built, KVC_KERNELS=off, `--no-cpu-kernels`)."""
    path = getattr(runner.kernels, "path", None)  # (the CPU library's; the GPU's Triton kernels have none)
    if path is None or runner.device.type != "cpu":
        return None
    from kvcentric.engine.model.kernels import CpuMasks  # (a CPU engine's: the library is built already)
    return CpuMasks(path)
