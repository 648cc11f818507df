"""What an engine knows of its own speed: each prefill chunk and decode step timed in the model thread, a
short calibration of a few shapes at start, and the online fit of both (`kvcentric.core.costfit`) as the
`MeasuredCost` its load reports carry. It measures and fits; it schedules nothing.

A calibration timed while the machine was busy with other work (`cpuwatch`: other processes kept cores busy, or
this one did not get the CPU its threads asked for) measured the crowd, not the engine: the parts it timed are
reported as a guess (`MeasuredCost.guess`), which the conductor ranks by but never refuses work on. The engine
calibrates again while idle (`recalibrate`, every few seconds) and its samples replace the guessed ones; the
part counts as measured once a calibration was quiet, or agreed with the one before it (the machine is steadily
that busy: `steady`, trusted, but calibrated again now and then while idle, so that once the machine quiets
down the model follows within seconds), or once serving has timed enough steps of that part to replace it.

Old samples decay: a sample timed more than `SAMPLE_MAX_AGE_S` ago leaves the fit (`age_out`), and an idle engine
calibrates the parts that lost samples again, so a stale shape does not speak for a machine that has changed.

For tests, `--slow-step-s` with `--slow-while-file` makes every timed model call, and every prefill step, slower
while a file exists, as a machine busy with other work would.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.costfit import OnlineCostFit, PartFit, PartFitter, Sample
from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import MeasuredCost
from kvcentric.engine.service.cpuwatch import CpuWatch, Stretch
from kvcentric.engine.model.runner import ModelRunner

CALIBRATION_BUDGET_S = 3.0
"""Calibration stops after the shape that takes it past this many seconds."""
CALIBRATION_TOKENS = 256
"""The longest prefill chunk (and cached prefix) calibrated; serving teaches the rest."""
REPEAT = 2
"""Timings per calibrated shape (the first shape of each part runs once more before, untimed)."""
RESEND_EVERY = 20
"""A load report carries the model at least once in this many, so a conductor that starts later learns it."""
RECALIBRATION_BUDGET_S = 1.5
"""A calibration again while a part is a guess stops after the shape that takes it past this many seconds."""
STEADY_BUDGET_S = 0.5
"""A calibration again of a steady part (trusted, measured on a busy machine) stops past this many seconds."""
AGREE = 0.3
"""Two calibrations agree when the median of the later one's times over the earlier one's, shape by shape (over
what the earlier fit predicts where they share no shape), is within this share of 1."""
CHANGED = 2.0
"""A steady part becomes a guess again when a busy calibration's times are more than this factor off the one before
(a busy machine's timings scatter; a change of load, or a machine gone quiet under other work, moves them more)."""
SERVED_TO_MEASURE = 8
"""Steps of a guessed part timed while serving that replace the guess."""
SAMPLE_MAX_AGE_S = 600.0
"""A sample older than this leaves the fit (an idle engine then calibrates that part again): the model speaks for the
machine of the last ten minutes, not for one busier or quieter long ago."""


class SpeedMeter:
    """The timings of one engine and the cost model fitted to them."""

    def __init__(self, runner: ModelRunner, model_name: str, prefill_chunk: int, slow_step_s: float = 0.0,
                 slow_while_file: str = "") -> None:
        """`slow_step_s`, `slow_while_file`: for tests, every timed model call sleeps that much more while that
        file exists."""
        self.runner, self.model_name, self.prefill_chunk = runner, model_name, prefill_chunk
        self.slow_step_s, self.slow_while_file = slow_step_s, slow_while_file
        self.fit = OnlineCostFit()
        self.sent_version = -1
        self.reports = 0
        self.guess: set[str] = set()
        """The parts whose fit rests on a calibration timed while the machine was busy."""
        self.steady: set[str] = set()
        """The parts measured on a busy machine by calibrations that agreed: trusted, and calibrated again while idle
        until one is quiet."""
        self.guessed: dict[str, list[Sample]] = {"prefill": [], "decode": []}
        """The samples of each guessed or steady part that the next calibration or serving replaces."""
        self.served: dict[str, int] = {"prefill": 0, "decode": 0}
        """Steps of each guessed part timed while serving since it became a guess."""
        self.calibrations = 0
        self.last_stretch: Stretch | None = None
        """What the machine looked like during the latest calibration."""

    # ---------------------------------------------------------------- timing (in the model thread)

    def timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """`fn(*args)` and the seconds it took on the device (the compute stream waited for on CUDA)."""
        start = time.perf_counter()
        result = fn(*args)
        self.slow_down()
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
        return result, time.perf_counter() - start

    def slow_down(self) -> None:
        """For tests (in the model thread): sleep `slow_step_s` while `slow_while_file` exists."""
        if self.slow_step_s and os.path.exists(self.slow_while_file):
            time.sleep(self.slow_step_s)

    def prefill(self, n_new: int, n_cached: int, seconds: float) -> bool:
        """One prefill chunk timed while serving; True when the fit was redone."""
        return self.fit.add_prefill(n_new, n_cached, seconds, time.monotonic()) | self._served("prefill")

    def decode(self, batch: int, kv_tokens: int, seconds: float) -> bool:
        """One decode step timed while serving; True when the fit was redone."""
        return self.fit.add_decode(batch, kv_tokens, seconds, time.monotonic()) | self._served("decode")

    def age_out(self, max_age_s: float = SAMPLE_MAX_AGE_S) -> set[str]:
        """Old samples decay: those timed more than `max_age_s` ago leave the fit (`OnlineCostFit.expire`); returns
        the parts that lost some, which a calibration should measure again."""
        gone = self.fit.expire(time.monotonic() - max_age_s)
        return {part for part, count in gone.items() if count}

    @property
    def unsettled(self) -> set[str]:
        """The parts a calibration while idle should measure again: guessed or steady."""
        return self.guess | self.steady

    def _served(self, part: str) -> bool:
        """Enough steps of a guessed (or steady) part served replace its calibration: those samples go, the fit is
        redone."""
        if part not in self.guess and part not in self.steady:
            return False
        self.served[part] += 1
        if self.served[part] < SERVED_TO_MEASURE:
            return False
        self._part(part).window.discard(self.guessed[part])
        self._measured(part)
        return self.fit.refit()

    def _part(self, part: str) -> PartFitter:
        return self.fit.prefill if part == "prefill" else self.fit.decode

    def _measured(self, part: str) -> None:
        self.guess.discard(part)
        self.steady.discard(part)
        self.guessed[part], self.served[part] = [], 0

    # ---------------------------------------------------------------- calibration (in the model thread)

    def calibrate(self, pool: BlockPool, prefill: bool, decode: bool, max_batch: int,
                  budget_s: float = CALIBRATION_BUDGET_S) -> int:
        """Time a few prefill and decode shapes with the pool's free blocks, then fit; returns the shapes timed.
        Stops early past `budget_s` (a slow model on a slow machine learns the rest by serving). Run again, it
        replaces what an earlier calibration timed on a busy machine."""
        deadline = time.perf_counter() + budget_s
        prefills = [("prefill", shape) for shape in self.prefill_shapes(pool)] if prefill else []
        decodes = [("decode", shape) for shape in self.decode_shapes(pool, max_batch)] if decode else []
        shapes = [s for pair in itertools.zip_longest(prefills, decodes) for s in pair if s is not None]
        before = {part: self._part(part).fit for part in ("prefill", "decode")}
        taken: dict[str, list[Sample]] = {"prefill": [], "decode": []}
        watch = CpuWatch(check_own=self.runner.device.type == "cpu")
        timed = 0
        for kind, (a, b) in shapes:  # small shapes of both parts first, so a short budget still covers both
            if time.perf_counter() > deadline and all(taken[part] for part, _ in shapes):
                break  # past the budget, once every part asked for has a shape timed
            warm_up = timed < (1 if self.calibrations else 2)  # a calibration again: the first shape after idling
            if kind == "prefill":
                taken[kind] += self._time_prefill(pool, a, b, warm_up)
            else:
                taken[kind] += self._time_decode(pool, a, b, warm_up)
            timed += 1
        self.last_stretch = watch.stretch(self.runner.threads or torch.get_num_threads())
        self.calibrations += 1
        self._settle(taken, before)
        return timed

    def _settle(self, taken: dict[str, list[Sample]], before: dict) -> None:
        """A calibration's samples in, replacing those of an earlier busy one: each part it timed is measured when
        the machine was quiet meanwhile; else steady when it agrees with the part's fit before it (a guess or
        steady already), else a guess."""
        busy = self.last_stretch is not None and self.last_stretch.busy
        for part, samples in taken.items():
            if not samples:
                continue
            tolerance = CHANGED - 1 if part in self.steady else AGREE
            agrees = part in self.unsettled and self.agrees(part, samples, before[part], self.guessed[part], tolerance)
            self._part(part).window.discard(self.guessed[part])
            if not busy:
                self._measured(part)
                continue
            (self.steady if agrees else self.guess).add(part)
            (self.guess if agrees else self.steady).discard(part)
            self.guessed[part], self.served[part] = list(samples), 0
        self.fit.refit()

    def agrees(self, part: str, samples: list[Sample], fit: PartFit | None, earlier: Sequence[Sample] = (),
               tolerance: float = AGREE) -> bool:
        """Whether these samples' times are those of the `earlier` calibration's samples of the same shapes, or
        where there are none what `fit`, the part's fit before they came, predicts: the median ratio within
        `tolerance` of 1 (and at least 1 / (1 + tolerance))."""
        times: dict[tuple[float, float], list[float]] = {}
        for a, b, seconds in earlier:
            times.setdefault((a, b), []).append(seconds)
        ratios = [s[2] / statistics.median(times[(s[0], s[1])]) for s in samples if (s[0], s[1]) in times]
        if not ratios and fit is not None:
            fitter = self._part(part)
            ratios = [s[2] / predicted for s in samples if (predicted := fitter.predict(s[0], s[1], fit)) > 0]
        if not ratios:
            return False
        ratio = statistics.median(ratios)
        return 1 / (1 + tolerance) <= ratio <= 1 + tolerance

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

    def _time_prefill(self, pool: BlockPool, new: int, cached: int, warm_up: bool) -> list[Sample]:
        table = pool.allocate(pool.blocks_for(new + cached))
        taken = []
        try:
            tokens = torch.randint(0, self.runner.config.vocab_size, (new + cached,)).tolist()
            if cached:
                self.runner.prefill(tokens, table, 0, cached)
            for run in range(REPEAT + warm_up):
                _, seconds = self.timed(self.runner.prefill, tokens, table, cached)
                if run or not warm_up:
                    taken.append(self._take(self.fit.prefill, new, cached, seconds))
        finally:
            pool.free(table)
        return [s for s in taken if s is not None]

    def _time_decode(self, pool: BlockPool, batch: int, context: int, warm_up: bool) -> list[Sample]:
        tables = [pool.allocate(pool.blocks_for(context + 1)) for _ in range(batch)]
        taken = []
        try:
            for run in range(REPEAT + warm_up):
                _, seconds = self.timed(self.runner.decode, [1] * batch, [context] * batch, tables)
                if run or not warm_up:
                    taken.append(self._take(self.fit.decode, batch, batch * (context + 1), seconds))
        finally:
            for table in tables:
                pool.free(table)
        return [s for s in taken if s is not None]

    @staticmethod
    def _take(part: PartFitter, a: int, b: int, seconds: float) -> Sample | None:
        """One calibration timing into the part's window (the fit is redone once the calibration ends)."""
        if not seconds > 0:
            return None
        part.add(a, b, seconds, time.monotonic())
        return part.last

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
                            version=fit.version, guess=sorted(self.guess))

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
