"""What an engine knows of its own speed: each prefill chunk and decode step timed in the model thread, a
short calibration of a few shapes at start, and the online fit of both (`kvcentric.core.costfit`) as the
`MeasuredCost` its load reports carry. It measures and fits; it schedules nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.costfit import OnlineCostFit, PartFitter
from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import MeasuredCost
from kvcentric.engine.runner import ModelRunner

CALIBRATION_BUDGET_S = 3.0
"""Calibration stops after the shape that takes it past this many seconds."""
CALIBRATION_TOKENS = 256
"""The longest prefill chunk (and cached prefix) calibrated; serving teaches the rest."""
REPEAT = 2
"""Timings per calibrated shape (the first shape of each part runs once more before, untimed)."""
RESEND_EVERY = 20
"""A load report carries the model at least once in this many, so a conductor that starts later learns it."""


class SpeedMeter:
    """The timings of one engine and the cost model fitted to them."""

    def __init__(self, runner: ModelRunner, model_name: str, prefill_chunk: int) -> None:
        self.runner, self.model_name, self.prefill_chunk = runner, model_name, prefill_chunk
        self.fit = OnlineCostFit()
        self.sent_version = -1
        self.reports = 0

    # ---------------------------------------------------------------- timing (in the model thread)

    def timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """`fn(*args)` and the seconds it took on the device (the compute stream waited for on CUDA)."""
        start = time.perf_counter()
        result = fn(*args)
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
        return result, time.perf_counter() - start

    def prefill(self, n_new: int, n_cached: int, seconds: float) -> bool:
        """One prefill chunk timed; True when the fit was redone."""
        return self.fit.add_prefill(n_new, n_cached, seconds)

    def decode(self, batch: int, kv_tokens: int, seconds: float) -> bool:
        """One decode step timed; True when the fit was redone."""
        return self.fit.add_decode(batch, kv_tokens, seconds)

    # ---------------------------------------------------------------- calibration (in the model thread)

    def calibrate(self, pool: BlockPool, prefill: bool, decode: bool, max_batch: int) -> int:
        """Time a few prefill and decode shapes with the pool's free blocks, then fit; returns the shapes timed.
        Stops early past CALIBRATION_BUDGET_S (a slow model on a slow machine learns the rest by serving)."""
        deadline = time.perf_counter() + CALIBRATION_BUDGET_S
        prefills = [("prefill", shape) for shape in self.prefill_shapes(pool)] if prefill else []
        decodes = [("decode", shape) for shape in self.decode_shapes(pool, max_batch)] if decode else []
        shapes = [s for pair in itertools.zip_longest(prefills, decodes) for s in pair if s is not None]
        timed = 0
        for kind, (a, b) in shapes:  # small shapes of both parts first, so a short budget still covers both
            if time.perf_counter() > deadline:
                break
            if kind == "prefill":
                self._time_prefill(pool, a, b, warm_up=timed < 2)
            else:
                self._time_decode(pool, a, b, warm_up=timed < 2)
            timed += 1
        self.fit.refit()
        return timed

    def prefill_shapes(self, pool: BlockPool) -> list[tuple[int, int]]:
        """(new, cached) from a small chunk to a full one, with no prefix and with a chunk-long one, cheapest
        first."""
        limit = min(self.prefill_chunk, CALIBRATION_TOKENS, (self.runner.config.max_position - 1) // 2,
                    pool.num_free * pool.block_size // 2)
        sizes = sorted({max(1, limit // 8), max(1, limit // 2), limit})
        shapes = [(new, cached) for cached in (0, limit) for new in sizes if limit >= 16]
        return sorted(shapes, key=lambda shape: shape[0] * (shape[0] + shape[1]))

    def decode_shapes(self, pool: BlockPool, max_batch: int) -> list[tuple[int, int]]:
        """(batch, context per sequence) over a few batch sizes and contexts that fit in the free blocks, cheapest
        first."""
        contexts = [c for c in (64, 256) if c < self.runner.config.max_position]
        batches = sorted({1, min(4, max_batch), min(16, max_batch)})
        shapes = [(b, c) for c in contexts for b in batches if b * pool.blocks_for(c + 1) <= pool.num_free]
        return sorted(shapes, key=lambda shape: shape[0] * shape[1])

    def _time_prefill(self, pool: BlockPool, new: int, cached: int, warm_up: bool) -> None:
        table = pool.allocate(pool.blocks_for(new + cached))
        try:
            tokens = torch.randint(0, self.runner.config.vocab_size, (new + cached,)).tolist()
            if cached:
                self.runner.prefill(tokens, table, 0, cached)
            for run in range(REPEAT + warm_up):
                _, seconds = self.timed(self.runner.prefill, tokens, table, cached)
                if run or not warm_up:
                    self.prefill(new, cached, seconds)
        finally:
            pool.free(table)

    def _time_decode(self, pool: BlockPool, batch: int, context: int, warm_up: bool) -> None:
        tables = [pool.allocate(pool.blocks_for(context + 1)) for _ in range(batch)]
        try:
            for run in range(REPEAT + warm_up):
                _, seconds = self.timed(self.runner.decode, [1] * batch, [context] * batch, tables)
                if run or not warm_up:
                    self.decode(batch, batch * (context + 1), seconds)
        finally:
            for table in tables:
                pool.free(table)

    # ---------------------------------------------------------------- what it publishes

    def cost_model(self, prior: CostModel) -> CostModel:
        """`prior` with the parts measured here replaced by their fit."""
        return self.fit.model(prior, f"measured:{self.model_name}@{self.runner.device}")

    def measured(self) -> MeasuredCost:
        fit = self.fit
        return MeasuredCost(prefill=_coefficients(fit.prefill), decode=_coefficients(fit.decode),
                            prefill_error=_error(fit.prefill), decode_error=_error(fit.decode),
                            prefill_samples=fit.prefill.seen, decode_samples=fit.decode.seen,
                            last_prefill=list(fit.prefill.last or ()), last_decode=list(fit.decode.last or ()),
                            prefill_chunk=self.prefill_chunk, kv_bytes_per_token=self.kv_bytes_per_token,
                            model=self.model_name, device=str(self.runner.device), dtype=self.runner.dtype_name,
                            version=fit.version)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.config.kv_bytes_per_token(self.runner.k_cache.element_size())

    def for_report(self) -> MeasuredCost | None:
        """The model for the next load report: when refitted since the last one sent, and every
        RESEND_EVERY reports; None otherwise, or before any fit."""
        self.reports += 1
        fitted = self.fit.prefill.fit is not None or self.fit.decode.fit is not None
        if not fitted or (self.fit.version == self.sent_version and self.reports % RESEND_EVERY):
            return None
        self.sent_version = self.fit.version
        return self.measured()


def _coefficients(part: PartFitter) -> list[float]:
    return list(part.fit.coefficients) if part.fit is not None else []


def _error(part: PartFitter) -> float:
    return round(part.fit.mean_rel_error, 4) if part.fit is not None else -1.0
