"""Mixed steps for the colocated role: one forward pass per step computes the decode batch's new tokens and
prefill chunks of as many prompts as fit a token budget (the mixed batches of Sarathi-Serve and vLLM's chunked
prefill), so the weights are read once per step and short prompts share a pass instead of one pass each.

It schedules, runs and records steps of a `ColocatedEngine`, whose prefill and decode parts keep their own
bookkeeping (blocks, preemption, stopping, hand-over); it decides nothing about those. Decode rows attend over the
paged cache either through the padded block-table gather (`padded`, one attention call per layer) or one
sequence at a time over exactly its slots (`slices`, no padding). Only `execute` touches torch.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from kvcentric.core.protocol import TokenChunk
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.batch import AttentionBatch, SequenceSlice
from kvcentric.engine.cores.prefill import PrefillChunk
from kvcentric.engine.model.runner import ModelRunner, padded_decode

DecodeAttention = Literal["padded", "slices"]


@dataclasses.dataclass
class MixedStep:
    chunks: list[PrefillChunk]
    """Prefill chunks, at most one per prompt, in the order their prompts started."""
    batch: list[DecodeRequest]
    """The decode batch: one new token each."""

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.batch

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.end - chunk.start for chunk in self.chunks)


def lane_prompt_share(step_tokens: int, threads: int, lane_computing: bool, waiting_tokens: int) -> float:
    """The share of its prompt budget a colocated model thread's next mixed step takes beside a lane (`node.Lane`):
    all of it, or that of one thread fewer while the lane computes or will start beside the step (more prompt
    tokens than a step's wait after it takes that share, as the lane's own test has it). A full budget on one
    thread of two takes twice a step's time, and the step's decode rows, the running requests' next tokens, wait
    that long; with the share a burst's longest gaps between tokens are about halved at the same output tokens/s
    (docs/performance.md, "Time between tokens in a burst")."""
    if threads < 2:
        return 1.0
    share = (threads - 1) / threads
    return share if lane_computing or waiting_tokens - share * step_tokens > step_tokens else 1.0


class MixedStepper:
    def __init__(self, engine: ColocatedEngine, step_tokens: int, decode_attention: DecodeAttention = "padded") -> None:
        """`step_tokens`: the token budget of one step, decode tokens first, prompt tokens in what is left."""
        if step_tokens < 1:
            raise ValueError("step_tokens must be at least 1")
        self.engine, self.step_tokens, self.decode_attention = engine, step_tokens, decode_attention

    def schedule(self, prompt_share: float = 1.0) -> tuple[MixedStep, list[TokenChunk]]:
        """The decode batch (as the decode part schedules it), then prompt chunks under `prompt_share` of the
        budget it leaves (at least a token while it leaves any): prompts in progress first (not one a lane
        computes now: `PrefillEngine.computing`), then queued ones in order while their blocks fit."""
        batch, failed = self.engine.decode.schedule()
        budget = self.step_tokens - len(batch)
        if budget > 0 and prompt_share < 1.0:
            budget = max(1, int(budget * prompt_share))
        return MixedStep(self._chunks(budget), batch), failed

    def _chunks(self, budget: int) -> list[PrefillChunk]:
        prefill = self.engine.prefill
        if prefill.writer is not None:
            prefill.writer.collect()
        chunks, running = [], prefill.idle_running()
        while budget > 0:
            work = running.pop(0) if running else prefill._start_next()
            if work is None:
                break
            end = min(work.done + budget, work.num_tokens)
            chunks.append(PrefillChunk(work, work.done, end))
            budget -= end - work.done
        return chunks

    def execute(self, step: MixedStep) -> tuple[list[int | None], list[int]]:
        """Run the step: the first token of each chunk that ends its prompt (None for the others), and the
        decode batch's next tokens. A prompt that asked for prompt logprobs runs alone (it needs every row)."""
        prefill, decode = self.engine.prefill, self.engine.decode
        masks = decode.sampler.start(step.batch)  # the guided rows' masks, computed while the model runs (off the CPU)
        decode._recompute([r for r in step.batch if r.recompute])
        scored = {id(c): prefill.execute(c) for c in step.chunks if c.work.job.sampling.prompt_logprobs is not None}
        plain = [c for c in step.chunks if id(c) not in scored]
        if not plain and not step.batch:  # every chunk asked for prompt logprobs: nothing else to run
            return [scored[id(c)] for c in step.chunks], []
        for chunk in plain:  # one batched forward for all chunks: their prefixes are loaded before it
            prefill.settle(chunk.work)
        last_logits, decode_logits = forward(self.engine.runner, plain, step.batch, self.decode_attention)
        ends = iter(last_logits)
        firsts = {id(c): prefill.sample_first(c.work, next(ends)) if c.last else None for c in plain}
        tokens = decode.sampler.choose_all(decode_logits, step.batch, masks) if step.batch else []
        return [{**scored, **firsts}[id(c)] for c in step.chunks], tokens

    def step(self) -> list[TokenChunk]:
        """schedule, execute, update in one call (for benchmarks and tests)."""
        step, out = self.schedule()
        if not step.empty:
            firsts, tokens = self.execute(step)
            out += self.update(step, firsts, tokens)
        return out

    def update(self, step: MixedStep, firsts: list[int | None], tokens: list[int]) -> list[TokenChunk]:
        out = self.engine.decode.update(step.batch, tokens) if step.batch else []
        for chunk, first in zip(step.chunks, firsts):
            out += self.engine.update(chunk, first, [], [])
        return out

    def fail_step(self, step: MixedStep, error: str) -> list[TokenChunk]:
        """The step raised: end every prompt it computed and its decode batch with the error."""
        out = self.engine.fail_step(None, step.batch, error)
        for chunk in step.chunks:
            out += self.engine.fail_step(chunk, [], error)
        return out


def forward(runner: ModelRunner, chunks: list[PrefillChunk], batch: list[DecodeRequest],
            decode_attention: DecodeAttention = "padded") -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the chunks' prompt tokens and the batch's new tokens: logits of the last position of each
    chunk that ends its prompt, and of every decode row."""
    if not chunks and batch and decode_attention == "padded" and runner.layered is None:
        # a decode-only step: the runner's own, replayed from CUDA graphs where it captured them
        logits = runner.decode([r.generated[-1] for r in batch], [r.position for r in batch], [r.blocks for r in batch])
        return logits[:0], logits
    runner._wait_for_received_kv()
    device, window = runner.device, runner.config.sliding_window
    prompts = runner.prompt_rows([(c.work.job.token_ids, c.work.blocks, c.start, c.end) for c in chunks])
    ids, positions, writes, sequences = prompts.ids, prompts.positions, prompts.writes, prompts.sequences
    rows = [row for row, chunk in zip(prompts.last_rows, chunks) if chunk.last]
    decode_start = len(ids)
    ids += [r.generated[-1] for r in batch]
    rows += range(decode_start, len(ids))
    at = [r.position for r in batch]
    positions.append(torch.tensor(at, dtype=torch.long))
    padded = None
    if decode_attention == "slices" or not batch:
        for row, request in enumerate(batch):
            context = runner._slots(request.blocks, 0, request.position + 1)
            sequences.append(SequenceSlice(decode_start + row, decode_start + row + 1, context, at[row], window))
            writes.append(context[-1:])
    else:
        padded = padded_decode(at, [r.blocks for r in batch], runner.block_size, window, device)
        writes.append(padded.write)
    attention = AttentionBatch(torch.cat(positions).to(device), torch.cat([w.to(device) for w in writes]), sequences,
                               padded=padded, block_size=runner.block_size, padded_start=decode_start,
                               kernels=runner.kernels)
    logits = runner.model(torch.tensor(ids, device=device), attention, runner.k_cache, runner.v_cache,
                          torch.tensor(rows, dtype=torch.long, device=device))
    ends = sum(chunk.last for chunk in chunks)
    return logits[:ends], logits[ends:]
