"""Chunked pipeline parallelism's arithmetic (Mooncake §5.1): which layers each stage of a prefill group
holds, the chunks a prompt is cut into, the order in which stages compute them, and the pipelined T_prefill
of a group. Pure; it computes no model and sends nothing.

A group of X stages prefills one prompt in chunks of at most `chunk` tokens: stage i computes chunk c while
stage i+1 computes chunk c-1, so with k chunks the prompt is done after k + X - 1 steps of the slowest stage
(each step one stage's slice of one chunk), instead of k steps of the whole model on one instance.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from kvcentric.core.costmodel import CostModel

STAGE = re.compile(r"(\d+)/(\d+)")


@dataclasses.dataclass(frozen=True)
class StagePosition:
    """Where an instance sits in a prefill group: stage `index` of `stages` (from 0) of group `group`."""

    group: str
    index: int
    stages: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def parse_stage(text: str) -> tuple[int, int]:
    """"i/X" -> (i, X); 0 <= i < X. Raises ValueError naming what is wrong."""
    match = STAGE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"expected i/X (stage i of X, from 0), got {text!r}")
    index, stages = int(match[1]), int(match[2])
    if stages < 1 or not 0 <= index < stages:
        raise ValueError(f"stage {index} of {stages}: need 0 <= i < X")
    return index, stages


def stage_layers(num_layers: int, stages: int, index: int) -> range:
    """The layers stage `index` of `stages` holds: contiguous, as even as can be, earlier stages one more."""
    if not 0 <= index < stages <= num_layers:
        raise ValueError(f"stage {index} of {stages} over {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def chunk_bounds(n_tokens: int, start: int, chunk: int) -> list[tuple[int, int]]:
    """The chunks [s, e) that compute tokens start..n_tokens-1, at most `chunk` tokens each."""
    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    return [(s, min(s + chunk, n_tokens)) for s in range(start, n_tokens, chunk)]


def pipeline_steps(chunks: int, stages: int) -> list[list[tuple[int, int]]]:
    """The pipeline's schedule: step t lists the (stage, chunk) pairs computed at once, stage i on chunk
    t - i; there are chunks + stages - 1 steps."""
    return [[(stage, step - stage) for stage in range(stages) if 0 <= step - stage < chunks]
            for step in range(chunks + stages - 1)]


def pipelined_makespan_s(stage_chunk_s: Sequence[Sequence[float]], hop_s: float = 0.0) -> float:
    """When the last stage finishes the last chunk, given `stage_chunk_s[i][c]` (seconds stage i computes
    chunk c) and `hop_s` (hidden states of one chunk to the next stage): a stage starts a chunk once it
    finished the one before and the previous stage handed this one over."""
    done_prev: list[float] = []
    for stage, times in enumerate(stage_chunk_s):
        free, done = 0.0, []
        for chunk, seconds in enumerate(times):
            ready = done_prev[chunk] + hop_s if stage else 0.0
            free = max(free, ready) + seconds
            done.append(free)
        done_prev = done
    return done_prev[-1] if done_prev else 0.0


def pipelined_t_prefill(costs: Sequence[CostModel], n_new: int, n_cached: int, chunk: int,
                        share: float = 1.0, hop_s: float = 0.0) -> float:
    """T_prefill of a group whose stage i runs at `costs[i]` (its own measured model; or the whole model's,
    each stage doing `share` of it): every chunk's time on every stage, pipelined (`pipelined_makespan_s`).
    With equal stages and chunks it is the slowest stage's chunk time x (chunks + X - 1)."""
    bounds = chunk_bounds(n_cached + n_new, n_cached, chunk)
    times = [[share * cost.t_prefill(end - start, start) for start, end in bounds] for cost in costs]
    return pipelined_makespan_s(times, hop_s)
