"""Uncached-length distributions: the paper's truncated log-normal, explicit lengths, Mooncake traces."""

import json
import math

import numpy as np
import pytest

from kvcentric.core.prfaas.inputs import InputError
from kvcentric.core.prfaas.workload import LengthDistribution, from_trace, load_workload, lognormal, workload_from_dict


def paper_workload():
    return lognormal(9.90, 1.00, 128, 131072, 1024)


def _phi(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def test_split_gives_p_and_the_two_conditional_means():
    dist = LengthDistribution.from_samples([100, 200, 300, 400], 10)
    p, above, below = dist.split([250, 0, 400])
    assert list(p) == pytest.approx([0.5, 1.0, 0.0])
    assert above[0] == pytest.approx(350) and below[0] == pytest.approx(150)
    assert above[1] == pytest.approx(250) and np.isnan(below[1])  # nothing at or below t = 0
    assert np.isnan(above[2]) and below[2] == pytest.approx(250)
    assert dist.split([250], values=[1, 2, 3, 4])[1][0] == pytest.approx(3.5)


def test_a_length_equal_to_the_threshold_stays_local():
    dist = LengthDistribution.from_samples([100, 200], 10)
    assert dist.split([100])[0][0] == pytest.approx(0.5)  # l > t goes to PrfaaS, l <= t stays (§3.3)


def test_repeated_lengths_are_weighted_by_count_and_quantiles_follow_the_weights():
    dist = LengthDistribution.from_samples([5, 5, 5, 100], 1)
    assert dist.mean == pytest.approx(28.75)
    assert dist.quantile(0.5) == 5 and dist.quantile(0.9) == 100


def test_lognormal_matches_the_closed_form_of_the_truncated_distribution():
    dist = paper_workload()
    mu, sigma, high = 9.90, 1.00, 131072
    mass = _phi((math.log(high) - mu) / sigma) - _phi((math.log(128) - mu) / sigma)
    mean = math.exp(mu + sigma ** 2 / 2) * (_phi((math.log(high) - mu - sigma ** 2) / sigma)
                                             - _phi((math.log(128) - mu - sigma ** 2) / sigma)) / mass
    assert dist.mean == pytest.approx(mean, rel=1e-4)
    assert 27_000 < dist.mean < 28_000  # "a mean of approximately 27K tokens" (§4.1)
    t = 19_400
    p_closed = (_phi((math.log(high) - mu) / sigma) - _phi((math.log(t) - mu) / sigma)) / mass
    assert dist.split([t])[0][0] == pytest.approx(p_closed, abs=2e-4)
    assert dist.split([t])[0][0] == pytest.approx(0.496, abs=0.001)  # §4.3.1: 49.6% offloaded at t = 19.4K


def test_workload_file_kinds(tmp_path):
    dist = workload_from_dict({"kind": "lengths", "input_lengths": [10, 20], "output_length": 5})
    assert dist.mean == 15 and dist.output_length == 5
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"kind": "lognormal", "mu": 9.9, "sigma": 1.0, "min_length": 128,
                                "max_length": 131072, "output_length": 1024, "bins": 512}))
    assert load_workload(path).mean == pytest.approx(paper_workload().mean, rel=1e-3)


def _write_trace(path, rows):
    path.write_text("".join(json.dumps(dict(zip(("timestamp", "input_length", "output_length", "hash_ids"), r)))
                            + "\n" for r in rows))


def test_trace_lengths_are_uncached_after_prefix_matching(tmp_path):
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [(0, 1200, 10, [1, 2, 3]),        # nothing cached: 1200
                         (1000, 1300, 30, [1, 2, 4]),     # blocks 1, 2 cached: 1300 - 1024 = 276
                         (2000, 700, 20, [5, 2])])        # 5 is new, so no prefix hit: 700
    dist = from_trace(trace)
    assert sorted(dist.lengths) == [276, 700, 1200]
    assert dist.output_length == pytest.approx(20)
    assert dist.offered_rps == pytest.approx(1.5)  # 3 requests over 2 s
    assert sorted(from_trace(trace, prefix_cache="none").lengths) == [700, 1200, 1300]
    assert from_trace(trace, limit=1).lengths.tolist() == [1200]


def test_a_fully_cached_request_still_computes_one_token(tmp_path):
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [(0, 1024, 1, [1, 2]), (5, 1024, 1, [1, 2])])
    assert from_trace(trace).lengths.tolist() == [1, 1024]


def test_the_shared_mooncake_trace_loads_when_present(shared):
    path = shared / "traces" / "conversation_trace.jsonl"
    try:
        dist = from_trace(path, limit=500)
    except OSError:
        pytest.skip("shared traces not present")
    assert 1 <= dist.lengths[0] and dist.offered_rps > 0 and len(dist.lengths) <= 500


@pytest.mark.parametrize("data, message", [
    ({"kind": "poisson"}, "workload: kind: expected one of"),
    ({"kind": "lognormal", "mu": 9.9, "sigma": 0, "min_length": 1, "max_length": 2, "output_length": 1},
     "workload: sigma: must be > 0"),
    ({"kind": "lognormal", "mu": 9.9, "sigma": 1, "min_length": 10, "max_length": 5, "output_length": 1},
     "workload: max_length: must be > min_length"),
    ({"kind": "lognormal", "mu": 9.9, "sigma": 1, "min_length": 10, "max_length": 50},
     "workload: output_length: missing"),
    ({"kind": "lengths", "input_lengths": [10, 0], "output_length": 1}, r"workload: input_lengths\[1\]: must be > 0"),
    ({"kind": "lengths", "input_lengths": [], "output_length": 1}, "workload: input_lengths: expected a list"),
    ({"kind": "trace", "path": "/nonexistent.jsonl"}, "workload: path: no such trace file"),
    ({"kind": "trace", "path": "x", "prefix_cache": "lru"}, "workload: prefix_cache: expected one of"),
    ({"kind": "lengths", "input_lengths": [1], "output_length": 1, "speed": 2}, r"unknown field\(s\) speed"),
])
def test_bad_workloads_name_the_field(data, message, tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(InputError, match=message):
        workload_from_dict(data, tmp_path)


def test_bad_trace_lines_name_the_line_and_field(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                     '{"timestamp": 1, "input_length": "ten", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(InputError, match="workload: trace line 2: input_length: expected an integer"):
        from_trace(trace)
    trace.write_text("not json\n")
    with pytest.raises(InputError, match="workload: trace line 1: not JSON"):
        from_trace(trace)
    trace.write_text("\n")
    with pytest.raises(InputError, match="holds no requests"):
        from_trace(trace)
