"""The online cost fit (`kvcentric.core.costfit`): it converges on noisy synthetic timings, ignores outliers,
keeps its predictions when the batch mix changes, and leaves at zero the terms the data cannot tell apart."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcentric.core.costfit import OnlineCostFit, ShapeWindow, sparse_relative_nnls
from kvcentric.core.costmodel import CostModel

TRUE = CostModel((0.004, 2e-5, 4e-9, 2e-9), (0.003, 2e-4, 1e-7), 4096, "truth")
PRIOR = CostModel((1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0), 4096, "prior")


def prefill_shapes(rng: random.Random, count: int) -> list[tuple[int, int]]:
    return [(rng.choice([16, 64, 200, 512]), rng.choice([0, 0, 300, 1500])) for _ in range(count)]


def decode_shapes(rng: random.Random, count: int, batches=(1, 2, 4, 8, 16, 32)) -> list[tuple[int, int]]:
    shapes = []
    for _ in range(count):
        batch = rng.choice(batches)
        shapes.append((batch, batch * rng.randint(50, 1500)))
    return shapes


def feed(fit: OnlineCostFit, rng: random.Random, prefill=(), decode=(), noise: float = 0.05) -> None:
    for n, c in prefill:
        fit.add_prefill(n, c, TRUE.t_prefill(n, c) * rng.lognormvariate(0, noise))
    for b, k in decode:
        fit.add_decode(b, k, TRUE.t_decode(b, k) * rng.lognormvariate(0, noise))


def relative_error(model: CostModel, prefill, decode) -> tuple[float, float]:
    p = max(abs(model.t_prefill(n, c) / TRUE.t_prefill(n, c) - 1) for n, c in prefill)
    d = max(abs(model.t_decode(b, k) / TRUE.t_decode(b, k) - 1) for b, k in decode)
    return p, d


def test_the_fit_converges_on_noisy_timings():
    rng = random.Random(1)
    fit = OnlineCostFit()
    feed(fit, rng, prefill_shapes(rng, 200), decode_shapes(rng, 200), noise=0.05)
    model = fit.model(PRIOR)
    p, d = relative_error(model, prefill_shapes(rng, 50), decode_shapes(rng, 50))
    assert p < 0.08 and d < 0.08, (p, d, model)
    assert 0 < fit.prefill.fit.mean_rel_error < 0.08 and 0 < fit.decode.fit.mean_rel_error < 0.08
    assert model.source == "measured" and model.kv_bytes_per_token == PRIOR.kv_bytes_per_token


def test_outliers_are_left_out_and_do_not_bend_the_model():
    rng = random.Random(2)
    fit = OnlineCostFit()
    shapes = decode_shapes(rng, 300)
    for index, (b, k) in enumerate(shapes):
        slow = 20.0 if index % 10 == 3 else 1.0  # a pause of the process every tenth step
        fit.add_decode(b, k, TRUE.t_decode(b, k) * slow * rng.lognormvariate(0, 0.02))
    fit.decode.refit()
    _, d = relative_error(fit.model(PRIOR), [(16, 0)], decode_shapes(rng, 50))
    assert d < 0.05, fit.decode.fit
    assert fit.decode.fit.outliers > 0 and fit.decode.fit.mean_rel_error < 0.05


def test_without_trimming_the_same_outliers_would_bend_it():
    rng = random.Random(2)
    shapes = decode_shapes(rng, 300)
    rows = np.asarray([(b, k, TRUE.t_decode(b, k) * (20.0 if i % 10 == 3 else 1.0)) for i, (b, k) in enumerate(shapes)])
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    naive = sparse_relative_nnls(x, rows[:, 2])
    assert abs(naive[0] / TRUE.decode[0] - 1) > 0.1 or abs(naive[2] / TRUE.decode[2] - 1) > 0.1


def test_a_change_of_batch_mix_keeps_the_old_shapes_predicted():
    rng = random.Random(3)
    fit = OnlineCostFit()
    small = decode_shapes(rng, 200, batches=(1, 2, 3))
    feed(fit, rng, decode=small, noise=0.03)
    before = fit.model(PRIOR)
    large = decode_shapes(rng, 2000, batches=(24, 32, 48, 64))
    feed(fit, rng, decode=large, noise=0.03)
    after = fit.model(PRIOR)
    probe = decode_shapes(random.Random(9), 50, batches=(1, 2, 3))
    drift = max(abs(after.t_decode(b, k) / before.t_decode(b, k) - 1) for b, k in probe)
    _, d = relative_error(after, [(16, 0)], probe + decode_shapes(rng, 50, batches=(24, 32, 48, 64)))
    assert drift < 0.1 and d < 0.1, (before.decode, after.decode)


def test_terms_the_data_cannot_identify_stay_at_zero():
    fit = OnlineCostFit()
    for n in (32, 128, 512) * 4:  # never a cached prefix: p2 cannot be known
        fit.add_prefill(n, 0, TRUE.t_prefill(n, 0))
    fit.prefill.refit()
    p0, p1, p2, p3 = fit.prefill.fit.coefficients
    assert p2 == 0.0 and p0 > 0 and p1 > 0
    assert fit.prefill.fit.mean_rel_error < 0.02


def test_one_batch_size_gives_a_model_without_a_per_sequence_term():
    fit = OnlineCostFit()
    for k in (100, 400, 900, 1600) * 3:
        fit.add_decode(1, k, TRUE.t_decode(1, k))
    d0, d1, d2 = fit.decode.fit.coefficients
    assert d0 > 0 and d1 == 0.0 and d2 > 0  # fixed and per-sequence costs are one column here: the fixed kept


def test_one_prompt_length_gives_a_per_token_model_not_a_quadratic_one():
    fit = OnlineCostFit()
    for cached in (0, 256, 0, 256):  # n_new, n_new**2 and the fixed cost cannot be told apart
        fit.add_prefill(64, cached, TRUE.t_prefill(64, cached))
    fit.refit()
    p0, p1, p2, p3 = fit.prefill.fit.coefficients
    assert p1 > 0 and p2 > 0 and p0 == p3 == 0.0


def test_refits_come_every_few_samples_and_bump_the_version():
    fit = OnlineCostFit(refit_every=5)
    for i in range(3):
        fit.add_decode(1 + i, 100 * (i + 1), 0.01 + 0.001 * i)
    assert fit.decode.fit is not None and fit.version == 1  # the first fit as soon as there are enough
    versions = []
    for _ in range(10):
        fit.add_decode(2, 300, 0.012)
        versions.append(fit.version)
    assert versions == [1, 1, 1, 1, 2, 2, 2, 2, 2, 3]


def test_bad_samples_are_ignored():
    fit = OnlineCostFit()
    assert not fit.add_decode(1, 10, 0.0) and not fit.add_decode(1, 10, float("nan"))
    assert not fit.add_prefill(-1, 0, 0.1) and len(fit.prefill.window) == 0


def test_the_window_keeps_the_newest_few_of_each_shape_and_drops_the_stalest_shape():
    window = ShapeWindow(per_shape=2, max_shapes=2)
    for seconds in (1.0, 2.0, 3.0):
        window.add((16, 0, seconds))
    assert window.rows()[:, 2].tolist() == [2.0, 3.0]
    window.add((1024, 0, 4.0))
    window.add((16, 0, 5.0))  # feeds the first shape again: the second is now the stalest
    window.add((4, 4, 6.0))
    assert sorted(window.rows()[:, 2].tolist()) == [3.0, 5.0, 6.0]


def test_a_prior_keeps_the_parts_not_measured():
    fit = OnlineCostFit()
    for b, k in ((1, 100), (4, 800), (16, 3000), (8, 1000)):
        fit.add_decode(b, k, TRUE.t_decode(b, k))
    fit.refit()
    model = fit.model(PRIOR, "measured:x")
    assert model.prefill == PRIOR.prefill and model.source == "measured:x"
    assert model.decode == pytest.approx(TRUE.decode, rel=1e-3, abs=1e-9)


def test_old_samples_decay_and_the_fit_follows_the_machine_of_now():
    """A decode part timed at 2x its speed long ago (a busy machine), then a few quiet steps: while the old samples
    stay they hold the fit up; once expired the fit is the quiet machine's, and the newest few always stay."""
    fit = OnlineCostFit(refit_every=1)
    for at in range(20):  # at t = 0..19: 40 ms steps (busy)
        fit.add_decode(1 + at % 4, 256, 0.04, at=float(at))
    for at in range(100, 104):  # at t = 100..103: 20 ms steps (quiet)
        fit.add_decode(1 + at % 4, 256, 0.02, at=float(at))
    before = fit.decode.predict(2, 256)
    assert before > 0.03
    version = fit.version
    assert fit.expire(before=50.0) == {"prefill": 0, "decode": 16}  # 20, less 4 pushed out by newer ones
    assert fit.decode.predict(2, 256) == pytest.approx(0.02, rel=1e-3) and fit.version == version + 1
    assert fit.expire(before=1000.0)["decode"] == 1 and len(fit.decode.window) == 3  # min_samples stay


def test_the_window_expires_oldest_first_across_shapes():
    window = ShapeWindow(per_shape=4)
    for at, (a, b) in enumerate([(1, 64), (16, 64), (1, 64), (16, 64)]):
        window.add((a, b, 0.01 * (at + 1)), float(at))
    assert window.expire(before=2.0) == 2
    assert sorted(window.rows()[:, 2].round(3).tolist()) == [0.03, 0.04]
    assert window.expire(before=10.0, keep=1) == 1 and window.rows()[:, 2].round(3).tolist() == [0.04]
