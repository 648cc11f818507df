"""What structured output adds to a decode step: one decode step of a preset model (batch 1 and 8, every row
sampled at temperature 1) with and without a JSON-schema grammar's mask on every row, and the mask alone
(`Guides.allowed`) at the vocabulary sizes of the byte models, Llama 2 (32,000) and Llama 3 (128,256). The step
runs as a decode engine's does (`DecodeEngine.execute`): `BatchSampler.start` (on the CPU it begins nothing), the
forward pass, then `BatchSampler.choose_all`, which computes the batch's masks together and samples every row;
each row is fed the token it sampled, so its matcher moves on through the grammar as in serving, and a row that
ends starts again as a new sequence (a copy of the grammar's prototype). A plain batch and a guided one step in turn,
step by step, so the machine's moods fall on both alike. Goal: a masked step costs under 10% more than a plain one.

Usage:
    .venv/bin/python -m bench.serving.bench_guided [--models tiny small] [--steps 50] [--rounds 5]

Prints a table and writes bench/results/guided.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from kvcentric.core.protocol import DecodeJob, SamplingParams
from kvcentric.core.structured import parse_guide
from kvcentric.engine.cores.decode_sampling import BatchSampler, cpu_masks
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.guided import Guides
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import PRESETS
from bench import harness

RESULTS = harness.RESULTS
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 64},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                                           "count": {"type": "integer"}},
          "required": ["name", "tags", "count"], "additionalProperties": False}
GUIDE = parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA}}})
PREFIX = list(b'{"name":"a step of bench')
"""Output every row has produced when it starts: inside a string, where the most tokens are allowed."""
MAX_OUTPUT = 64
"""A row that has produced this many tokens starts again."""


class Stepper:
    """One batch of decode rows stepped as a decode engine steps them, with or without the grammar's mask."""

    def __init__(self, runner: ModelRunner, batch: int, guided: bool) -> None:
        self.runner, self.batch = runner, batch
        self.blocks = [[row * 4 + k for k in range(4)] for row in range(batch)]
        self.params = SamplingParams(temperature=1.0, seed=1, guide=GUIDE if guided else "", max_tokens=MAX_OUTPUT)
        self.guides = Guides(runner.config)
        self.sampler = BatchSampler(self.guides, runner.config.eos_token_ids, cpu_masks(runner))
        self.rows = [sequence(self.params, row, 0) for row in range(batch)]
        self.steps = 0

    def step(self) -> float:
        """Seconds of one decode step with every row sampled (and masked when guided); each row then takes its
        token, and a row that ends starts again as a new sequence."""
        started = time.perf_counter()
        masks = self.sampler.start(self.rows)
        logits = self.runner.decode([65] * self.batch, [len(PREFIX)] * self.batch, self.blocks)
        tokens = self.sampler.choose_all(logits, self.rows, masks)
        elapsed = time.perf_counter() - started
        self.steps += 1
        for row, token in enumerate(tokens):
            self.rows[row].generated.append(token)
            if token in self.runner.config.eos_token_ids or len(self.rows[row].generated) >= MAX_OUTPUT:
                self.guides.forget(self.rows[row].key)
                self.rows[row] = sequence(self.params, row, self.steps)
        return elapsed


def paired_s(runner: ModelRunner, batch: int, steps: int) -> tuple[float, float]:
    """Median seconds of a plain and of a guided decode step, the two taken in turn step by step (so a change in
    the machine's speed, a neighbour's burst or the CPU's clock, falls on both alike)."""
    plain, guided = Stepper(runner, batch, False), Stepper(runner, batch, True)
    times: tuple[list[float], list[float]] = ([], [])
    for step in range(steps + 3):
        for stepper, kept in ((plain, times[0]), (guided, times[1])) if step % 2 else \
                ((guided, times[1]), (plain, times[0])):
            elapsed = stepper.step()
            if step >= 3:
                kept.append(elapsed)
    return statistics.median(times[0]), statistics.median(times[1])


def sequence(params: SamplingParams, row: int, step: int) -> DecodeRequest:
    """A decode engine's sequence that has produced `PREFIX` (a new key: a new request); each row draws from its
    own seeded stream (its `index`), so the rows' matchers part ways."""
    job = DecodeJob(request_id=f"r{row}.{step}", n_prompt_tokens=1, sampling=params)
    return DecodeRequest(job, deadline=0.0, prompt=[256], generated=list(PREFIX), index=row)


def mask_s(vocab: int, steps: int) -> float:
    """Median seconds of one row's mask (the matcher fed one token more each step, as in serving)."""
    guides = Guides(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab))
    assert guides.tokenizer is not None  # built once, outside the timing
    times, output, key = [], list(PREFIX), 0
    for _ in range(steps):
        started = time.perf_counter()
        guides.allowed(f"r{key}", GUIDE, output)
        times.append(time.perf_counter() - started)
        output.append(ord("x"))
        if len(output) - len(PREFIX) >= 40:  # a new sequence before the string's maxLength (64) refuses the row
            guides.forget(f"r{key}")
            output, key = list(PREFIX), key + 1
    return statistics.median(times[3:])


def apply_s(vocab: int, steps: int) -> tuple[float, float] | None:
    """Median seconds to apply 8 rows' masks to their logits (rows inside the schema's string, where most of the
    vocabulary is allowed, and rows after it, where little is): the C++ op on the packed bitmask
    (`kernels.CpuMasks`), and torch's way (the bits unpacked into a bool tensor, one `where`). None without a
    compiler."""
    from kvcentric.engine.model import kernels
    from kvcentric.engine.model.sampling import refused_logit
    library = kernels.load()
    if library is None:
        return None
    masks_op = kernels.CpuMasks(library.path)
    guides = Guides(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab))
    outputs = [list(PREFIX) + [ord("x")] * row for row in range(4)] + \
        [list(b'{"name":"n","tags":["a"') + [ord(",")] * (row % 2) for row in range(4)]
    masks = guides.masks([(f"a{row}", GUIDE, output) for row, output in enumerate(outputs)], forced=False)
    assert masks.words is not None
    logits = torch.randn(len(outputs), vocab)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        block = logits.clone()
        started = time.perf_counter()
        masks_op.refuse(block, masks.address, masks.words_per_row, None)
        times[0].append(time.perf_counter() - started)
        started = time.perf_counter()
        bits = np.unpackbits(masks.words.view(np.uint8), axis=1, count=vocab, bitorder="little")
        torch.where(torch.from_numpy(bits.view(np.bool_)), logits, refused_logit(logits.device))
        times[1].append(time.perf_counter() - started)
    return statistics.median(times[0][3:]), statistics.median(times[1][3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=50, help="steps of each variant in a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of plain and guided steps taken in turn")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in args.models:
        runner = ModelRunner(PRESETS[model], 64, 16, 0, device="cpu")
        for batch in (1, 8):
            rounds = [paired_s(runner, batch, args.steps) for _ in range(args.rounds)]
            plain = statistics.median(p for p, _ in rounds)
            guided = statistics.median(g for _, g in rounds)
            overhead = statistics.median(g / p - 1 for p, g in rounds)
            rows.append({"model": model, "batch": batch, "plain_ms": plain * 1e3, "guided_ms": guided * 1e3,
                         "overhead": overhead, "rounds": [[p * 1e3, g * 1e3] for p, g in rounds]})
            print(f"{model:6} batch {batch}: plain {plain * 1e3:7.3f} ms  guided {guided * 1e3:7.3f} ms  "
                  f"+{100 * overhead:5.1f}% (median of {args.rounds} rounds' ratios)")
    masks = {vocab: mask_s(vocab, args.steps) * 1e6 for vocab in (258, 32000, 128256)}
    applied = {vocab: apply_s(vocab, args.steps) for vocab in (258, 32000, 128256)}
    for vocab, pair in applied.items():
        if pair is not None:
            print(f"8 rows' masks applied, vocabulary {vocab:6}: C++ op {pair[0] * 1e6:7.1f} us, torch's unpack and "
                  f"where {pair[1] * 1e6:7.1f} us")
    for vocab, micros in masks.items():
        print(f"mask alone, vocabulary {vocab:6}: {micros:7.1f} us")
    harness.write(RESULTS / "guided.json", harness.record("bench_guided", threads=torch.get_num_threads(),
                                                         steps=rows, mask_us=masks,
                                                         apply_us={vocab: None if pair is None else
                                                                   {"cpp_op": pair[0] * 1e6, "torch": pair[1] * 1e6}
                                                                   for vocab, pair in applied.items()}), indent=2)


if __name__ == "__main__":
    main()
