"""An instance's own cost model, fitted online from what it measures as it serves: prefill chunks as
(n_new, n_cached, seconds) and decode steps as (batch, kv_tokens, seconds), in `costmodel`'s forms. It fits;
it times nothing and reads no clock.

Samples are kept in a bounded window spread over shapes (a few of the newest per power-of-two bucket of each
dimension), so a change of the batch mix adds buckets instead of washing out the old ones. Each sample keeps when
it was timed (the caller's clock), and `expire` takes out those older than a given time, so that old samples decay
instead of speaking for a machine that has changed since. Every
`refit_every` samples the part is refitted by relative least squares with non-negative coefficients; samples
whose relative residual exceeds `trim` robust standard deviations (1.4826 x the median absolute residual) are
dropped and the fit repeated, so a pause of the process does not bend the model. Of the coefficient subsets
that fit about as well as the best one, the smallest is kept: terms the data cannot tell apart (every sample
with no cached prefix, one batch size only) stay at zero instead of taking arbitrary values.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from kvcentric.core.costmodel import CostModel

Sample = tuple[float, float, float]
"""(first dimension, second dimension, seconds): (n_new, n_cached, s) or (batch, kv_tokens, s)."""


PREFILL_PREFERENCE = (1, 0, 2, 3)
"""Which prefill term to keep first when the data cannot tell two apart (lower first): per token, then fixed,
then attention over the prefix, then among the new tokens."""
DECODE_PREFERENCE = (0, 2, 1)
"""Likewise for a decode step: the fixed cost (reading the weights), then per context token, then per sequence."""


def prefill_terms(n_new: np.ndarray, n_cached: np.ndarray) -> np.ndarray:
    """Columns of T_prefill = p0 + p1*n_new + p2*n_new*n_cached + p3*n_new**2."""
    return np.column_stack([np.ones_like(n_new), n_new, n_new * n_cached, n_new * n_new])


def decode_terms(batch: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
    """Columns of T_decode_step = d0 + d1*batch + d2*kv_tokens."""
    return np.column_stack([np.ones_like(batch), batch, kv_tokens])


@dataclasses.dataclass(frozen=True)
class PartFit:
    """One part's fitted coefficients and how well they match the samples they came from."""

    coefficients: tuple[float, ...]
    mean_rel_error: float
    """Mean |predicted - measured| / measured over the samples kept (outliers excluded)."""
    samples: int
    """Samples in the window when fitted."""
    outliers: int
    """Of those, how many were left out as outliers."""


class ShapeWindow:
    """The newest `per_shape` samples of each shape bucket, at most `max_shapes` buckets (the one fed
    longest ago leaves first). A bucket is the bit length of each dimension: 16..31 tokens is one."""

    def __init__(self, per_shape: int = 8, max_shapes: int = 32) -> None:
        if per_shape < 1 or max_shapes < 1:
            raise ValueError("per_shape and max_shapes must be at least 1")
        self.per_shape, self.max_shapes = per_shape, max_shapes
        self.buckets: collections.OrderedDict[tuple[int, int], collections.deque[tuple[Sample, float]]] = \
            collections.OrderedDict()
        """shape bucket -> its newest (sample, when it was timed)."""

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self.buckets.values())

    def add(self, sample: Sample, at: float = 0.0) -> None:
        key = (int(sample[0]).bit_length(), int(sample[1]).bit_length())
        bucket = self.buckets.pop(key, None) or collections.deque(maxlen=self.per_shape)
        bucket.append((sample, at))
        self.buckets[key] = bucket
        if len(self.buckets) > self.max_shapes:
            self.buckets.popitem(last=False)

    def rows(self) -> np.ndarray:
        return np.asarray([s for bucket in self.buckets.values() for s, _ in bucket], dtype=float).reshape(-1, 3)

    def discard(self, samples: list[Sample]) -> int:
        """Take these samples out (those still held: newer ones may have pushed some out); returns how many went.
        A bucket left empty goes too."""
        gone = 0
        for sample in samples:
            key = (int(sample[0]).bit_length(), int(sample[1]).bit_length())
            bucket = self.buckets.get(key)
            entry = next((e for e in bucket if e[0] == sample), None) if bucket is not None else None
            if bucket is not None and entry is not None:
                bucket.remove(entry)
                gone += 1
                if not bucket:
                    del self.buckets[key]
        return gone

    def expire(self, before: float, keep: int = 0) -> int:
        """Take out the samples timed before `before`, oldest first, leaving at least the newest `keep`; returns how
        many went."""
        aged = sorted((at, key) for key, bucket in self.buckets.items() for _, at in bucket if at < before)
        gone = 0
        for _, key in aged[:max(0, min(len(aged), len(self) - keep))]:
            bucket = self.buckets[key]
            bucket.popleft()  # a bucket's entries are in the order they were timed
            gone += 1
            if not bucket:
                del self.buckets[key]
        return gone


class PartFitter:
    """The online fit of one part (prefill or decode): a window of samples and its latest fit."""

    def __init__(self, terms: Callable[[np.ndarray, np.ndarray], np.ndarray], preference: tuple[int, ...], *,
                 per_shape: int = 8, max_shapes: int = 32, refit_every: int = 8, trim: float = 3.0,
                 min_samples: int = 3) -> None:
        if refit_every < 1 or trim <= 0 or min_samples < 1:
            raise ValueError("refit_every and min_samples must be at least 1, trim positive")
        self.terms, self.preference = terms, preference
        self.window = ShapeWindow(per_shape, max_shapes)
        self.refit_every, self.trim, self.min_samples = refit_every, trim, min_samples
        self.fit: PartFit | None = None
        self.fresh = 0
        """Samples added since the last fit."""
        self.seen = 0
        self.last: Sample | None = None

    def add(self, a: float, b: float, seconds: float, at: float = 0.0) -> bool:
        """Take one measurement, timed at `at` (the caller's clock); True when it triggered a refit."""
        if not seconds > 0 or a < 0 or b < 0:
            return False
        self.last = (float(a), float(b), float(seconds))
        self.window.add(self.last, at)
        self.seen += 1
        self.fresh += 1
        due = self.fresh >= (1 if self.fit is None else self.refit_every)
        return due and self.refit()

    def predict(self, a: float, b: float, fit: PartFit | None = None) -> float:
        """Seconds `fit` (default: the latest) predicts for one shape (0 without a fit)."""
        fit = fit or self.fit
        if fit is None:
            return 0.0
        return float(self.terms(np.asarray([float(a)]), np.asarray([float(b)]))[0] @ np.asarray(fit.coefficients))

    def expire(self, before: float) -> int:
        """Old samples decay: those timed before `before` leave the window (the newest `min_samples` stay, so the
        part keeps a fit), and the part is fitted again without them; returns how many went."""
        gone = self.window.expire(before, self.min_samples)
        if gone:
            self.refit()
        return gone

    def refit(self) -> bool:
        """Fit the window now; False when it holds too few samples."""
        rows = self.window.rows()
        if len(rows) < self.min_samples:
            return False
        x, y = self.terms(rows[:, 0], rows[:, 1]), rows[:, 2]
        coefficients, kept = robust_fit(x, y, self.trim, self.preference)
        relative = np.abs(x @ coefficients - y) / y
        self.fit = PartFit(tuple(float(c) for c in coefficients), float(relative[kept].mean()), len(rows),
                           int((~kept).sum()))
        self.fresh = 0
        return True


class OnlineCostFit:
    """Both parts of one instance's cost model, fitted online; `model` lays the fitted parts over a prior."""

    def __init__(self, *, per_shape: int = 8, max_shapes: int = 32, refit_every: int = 8, trim: float = 3.0) -> None:
        self.prefill = PartFitter(prefill_terms, PREFILL_PREFERENCE, per_shape=per_shape, max_shapes=max_shapes,
                                  refit_every=refit_every, trim=trim)
        self.decode = PartFitter(decode_terms, DECODE_PREFERENCE, per_shape=per_shape, max_shapes=max_shapes,
                                 refit_every=refit_every, trim=trim)
        self.version = 0
        """Bumped at every refit: whoever publishes the model sends it again when this moved."""

    def add_prefill(self, n_new: int, n_cached: int, seconds: float, at: float = 0.0) -> bool:
        return self._counted(self.prefill.add(n_new, n_cached, seconds, at))

    def add_decode(self, batch: int, kv_tokens: int, seconds: float, at: float = 0.0) -> bool:
        return self._counted(self.decode.add(batch, kv_tokens, seconds, at))

    def expire(self, before: float) -> dict[str, int]:
        """Old samples decay (`PartFitter.expire`): part -> how many of its samples went."""
        gone = {"prefill": self.prefill.expire(before), "decode": self.decode.expire(before)}
        self._counted(any(gone.values()))
        return gone

    def refit(self) -> bool:
        """Fit both parts now (after a calibration); True when either has a fit."""
        return self._counted(self.prefill.refit() | self.decode.refit())

    def _counted(self, refitted: bool) -> bool:
        self.version += refitted
        return refitted

    def model(self, prior: CostModel, source: str = "measured") -> CostModel:
        """`prior` with each part this fit has replaced by the fitted coefficients."""
        prefill, decode = self.prefill.fit, self.decode.fit
        p = prefill.coefficients if prefill else prior.prefill
        d = decode.coefficients if decode else prior.decode
        return dataclasses.replace(prior, prefill=(p[0], p[1], p[2], p[3]), decode=(d[0], d[1], d[2]), source=source)


def robust_fit(x: np.ndarray, y: np.ndarray, trim: float, preference: tuple[int, ...] = (),
               rounds: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients >= 0 minimising the relative error, refitted without the outliers of the previous round;
    returns them and the mask of samples kept."""
    kept = np.ones(len(y), dtype=bool)
    coefficients = sparse_relative_nnls(x, y, preference)
    for _ in range(rounds):
        relative = (x @ coefficients - y) / y
        scale = max(1.4826 * float(np.median(np.abs(relative[kept]))), 0.01)
        inside = np.abs(relative) <= trim * scale
        if inside.sum() < min(len(y), x.shape[1] + 1) or np.array_equal(inside, kept):
            break
        kept = inside
        coefficients = sparse_relative_nnls(x[kept], y[kept], preference)
    return coefficients, kept


def sparse_relative_nnls(x: np.ndarray, y: np.ndarray, preference: tuple[int, ...] = (), slack: float = 0.05,
                         floor: float = 0.002) -> np.ndarray:
    """min ||(x b - y)/y|| with b >= 0, preferring fewer non-zero terms: the smallest subset of columns whose
    root-mean-square relative error is at most (1 + `slack`) times the best subset's plus `floor`; between
    subsets of one size, the one whose columns come first in `preference` (rank per column; default: in order)."""
    rank = preference or tuple(range(x.shape[1]))
    weighted = x / y[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    usable = [i for i in range(x.shape[1]) if scale[i] > 0]
    scale[scale == 0] = 1.0
    a, ones = weighted / scale, np.ones_like(y)
    fits: list[tuple[tuple[int, ...], float, tuple[int, ...], np.ndarray]] = []
    for size in range(1, len(usable) + 1):
        for columns in itertools.combinations(usable, size):
            coef = np.linalg.lstsq(a[:, columns], ones, rcond=None)[0]
            if (coef >= 0).all():
                rms = float(np.sqrt(np.mean((a[:, columns] @ coef - ones) ** 2)))
                fits.append((tuple(sorted(rank[c] for c in columns)), rms, columns, coef))
    result = np.zeros(x.shape[1])
    if not fits:
        return result
    best = min(rms for _, rms, _, _ in fits)
    good_enough = best * (1 + slack) + floor
    _, _, columns, coef = min((f for f in fits if f[1] <= good_enough), key=lambda f: (len(f[0]), f[0], f[1]))
    result[list(columns)] = coef
    return result / scale
