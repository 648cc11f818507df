import json
import random

import numpy as np
import pytest

from kvcentric.core.costmodel import (HARDWARE, CostModel, decode_capacity_tokens, hardware, host_cache_blocks,
                                 nnls)
from kvcentric.model.config import preset

TRUE = CostModel((0.01, 2e-4, 1e-8, 5e-9), (0.02, 1e-4, 3e-7), 4096)


def samples(model: CostModel, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    jitter = lambda: 1.0 + rng.uniform(-noise, noise)  # noqa: E731
    prefill = [(n, c, model.t_prefill(n, c) * jitter()) for n in (16, 128, 512, 2048, 4096) for c in (0, 1024, 8192)]
    decode = [(b, k, model.t_decode(b, k) * jitter()) for b in (1, 4, 16, 64) for k in (100, 10_000, 100_000)]
    return prefill, decode


def test_t_prefill_and_t_decode_follow_the_documented_forms():
    assert TRUE.t_prefill(1000, 3000) == pytest.approx(0.01 + 2e-4 * 1000 + 1e-8 * 1000 * 3000 + 5e-9 * 1000 ** 2)
    assert TRUE.t_decode(8, 5000) == pytest.approx(0.02 + 1e-4 * 8 + 3e-7 * 5000)


def test_prefill_is_superlinear_in_new_tokens_and_linear_in_the_cached_prefix():
    assert TRUE.t_prefill(2000) - TRUE.t_prefill(1000) > TRUE.t_prefill(1000) - TRUE.t_prefill(0)
    step = [TRUE.t_prefill(100, c + 1000) - TRUE.t_prefill(100, c) for c in (0, 5000, 50000)]
    assert step == pytest.approx([step[0]] * 3)


def test_fit_recovers_exact_coefficients():
    model, report = CostModel.fit(*samples(TRUE), kv_bytes_per_token=4096)
    assert model.prefill == pytest.approx(TRUE.prefill, rel=1e-6)
    assert model.decode == pytest.approx(TRUE.decode, rel=1e-6)
    assert report["prefill"]["max_rel_error"] < 1e-6 and report["decode"]["max_rel_error"] < 1e-6


def test_fit_with_noise_reports_its_error_and_keeps_coefficients_non_negative():
    model, report = CostModel.fit(*samples(TRUE, noise=0.1, seed=3), kv_bytes_per_token=4096)
    assert all(c >= 0 for c in model.prefill + model.decode)
    assert 0 < report["prefill"]["mean_rel_error"] <= report["prefill"]["max_rel_error"] < 0.2
    assert report["samples"] == {"prefill": 15, "decode": 12}


def test_fit_clamps_a_coefficient_that_least_squares_would_make_negative():
    no_quadratic = CostModel((0.05, 1e-4, 0.0, 0.0), (0.01, 0.0, 1e-6), 1)
    prefill, decode = samples(no_quadratic)
    prefill = [(n, c, t * (1 - 1e-5 * n / 4096)) for n, c, t in prefill]  # slightly sublinear
    model, _ = CostModel.fit(prefill, decode, 1)
    assert model.prefill[3] == 0.0 and all(c >= 0 for c in model.prefill)


def test_nnls_matches_a_known_answer():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([1.0, -1.0, 0.0])) == pytest.approx([1 / 2, 0.0])


def test_fit_refuses_too_few_samples():
    with pytest.raises(ValueError, match="at least"):
        CostModel.fit([(1, 0, 1.0)], [(1, 1, 1.0)] * 3, 1)


def test_save_and_load_round_trip_and_load_reads_a_whole_profile(tmp_path):
    path = tmp_path / "cost.json"
    TRUE.save(path, hardware="test")
    assert json.loads(path.read_text())["hardware"] == "test"
    assert CostModel.load(path) == TRUE
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"model": "tiny", "samples": [], "cost_model": TRUE.to_dict()}))
    assert CostModel.load(profile) == TRUE
    assert CostModel.from_dict(TRUE.to_dict()) == TRUE


def test_from_dict_rejects_a_malformed_model():
    with pytest.raises(ValueError, match="cost model"):
        CostModel.from_dict({"prefill": [1, 2], "decode": [1, 2, 3], "kv_bytes_per_token": 1})
    with pytest.raises(ValueError, match="cost model"):
        CostModel.from_dict({"decode": [1, 2, 3]})


def test_roofline_of_llama2_70b_on_8_a800_is_in_the_papers_range():
    model = CostModel.roofline(preset("llama2-70b"), hardware("8xA800-800gbps"))
    assert model.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2  # 320 KiB per token in bf16
    assert 0.5 < model.t_prefill(8192) < 3.0  # an 8K prompt takes about a second on one node
    assert model.t_prefill(8192, 8192) > model.t_prefill(8192)
    assert 0.01 < model.t_decode(1, 1000) < 0.05  # one sequence: weights read once per step
    assert model.prefill[2] == pytest.approx(2 * model.prefill[3])


def test_capacities_follow_from_memory_sizes():
    model, spec = preset("llama2-70b"), HARDWARE["8xA800-800gbps"]
    assert 1_000_000 < decode_capacity_tokens(model, spec) < 2_000_000
    assert host_cache_blocks(model, spec, 512) == int(1e12 // (512 * 327_680))
    with pytest.raises(ValueError, match="does not fit"):
        decode_capacity_tokens(model, HARDWARE["cpu-2core"])


def test_unknown_hardware_names_the_presets():
    with pytest.raises(ValueError, match="cpu-2core"):
        hardware("tpu")
