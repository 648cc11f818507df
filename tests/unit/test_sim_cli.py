"""`kvcentric sim` and `kvcentric sim cache` through the real command line, on small traces."""

import json
import subprocess
import sys

import pytest

from kvcentric.core.sim.workload import load_trace, poisson_workload

TRACE_LINES = [
    {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]},
    {"timestamp": 500, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [3, 4]},
    {"timestamp": 1000, "input_length": 1024, "output_length": 30, "hash_ids": [0, 5]},
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TRACE_LINES))
    return path


def kvcentric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcentric", *args], capture_output=True, text=True, timeout=120)


def test_sim_writes_the_summary_the_requests_and_the_plots(trace, tmp_path):
    out = tmp_path / "out"
    result = kvcentric("sim", "--trace", str(trace), "--prefill", "2", "--decode", "2", "--out", str(out),
                       "--no-progress")
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 4 and summary["completed"] == 4 and summary["rejected_before_prefill"] == 0
    assert 0 < summary["prefix_hit_ratio"] < 1 and summary["cost_model"]["source"].startswith("roofline:llama2-70b")
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3"] and all(r["status"] == "completed" for r in rows)
    for name in ("ttft_cdf.png", "tbt_cdf.png", "load.png"):
        assert (out / name).stat().st_size > 1000
    assert json.loads(result.stdout)["completed"] == 4


def test_sim_colocated_poisson_with_a_profile(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"model": "small", "cost_model": {
        "prefill": [0.01, 1e-4, 0, 0], "decode": [0.02, 1e-4, 1e-7], "kv_bytes_per_token": 65536}}))
    result = kvcentric("sim", "--workload", "poisson", "--rps", "2", "--num-requests", "30", "--input-len", "2048",
                       "--output-len", "16", "--architecture", "colocated", "--instances", "3", "--chunked-prefill",
                       "--profile", str(profile), "--out", str(tmp_path / "out"), "--no-plots", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["completed"] == 30


def test_sim_names_a_bad_flag(trace, tmp_path):
    result = kvcentric("sim", "--trace", str(trace), "--cache-blocks", "many", "--out", str(tmp_path))
    assert result.returncode == 2 and "--cache-blocks" in result.stderr


def test_sim_cache_prints_hit_ratios_of_one_global_pool(trace):
    result = kvcentric("sim", "cache", "--trace", str(trace), "--policy", "lru", "--capacity", "inf")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"hit_ratio": round(3 / 9, 4), "prefix_hit_ratio": round(3 / 9, 4)}
    small = json.loads(kvcentric("sim", "cache", "--trace", str(trace), "--capacity", "1").stdout)
    assert small["hit_ratio"] < 3 / 9


def test_trace_loading_scales_time_and_keys_blocks_by_their_ids(trace):
    requests = load_trace(trace, speed=2.0)
    assert [r.arrival_s for r in requests] == [0.0, 0.25, 0.5, 0.5]
    assert requests[1].hashes == ["0", "1", "2"] and requests[0].hashes[0] is requests[1].hashes[0]
    assert len(load_trace(trace, limit=2)) == 2


def test_a_malformed_trace_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(path)


def test_poisson_workload_shares_the_requested_part_of_each_prompt():
    requests = poisson_workload(rps=5, num_requests=200, input_len=4096, output_len=8, cache_ratio=0.5,
                                block_tokens=512, prefixes=4, seed=1)
    assert all(len(r.hashes) == 8 and r.hashes[:4] == [f"{r.hashes[0][:-2]}.{i}" for i in range(4)] for r in requests)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:])]
    assert 0.1 < sum(gaps) / len(gaps) < 0.3


def readme_sim_examples() -> list[tuple[str, str]]:
    """(command, the output its comment promises if it is JSON, else "") for each `kvcentric sim` line of the
    README's "Conductor and simulator" section."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "docs" / "papers.md").read_text()
    section = readme.split("## Conductor and simulator", 1)[1].split("\n## ", 1)[0]
    examples = []
    for line in section.splitlines():
        if line.startswith("kvcentric sim"):
            command, _, comment = line.partition("#")
            examples.append((command.strip(), comment.strip() if comment.strip().startswith("{") else ""))
    return examples


def test_the_readme_sim_examples_run_and_print_what_they_say(tmp_path):
    examples = readme_sim_examples()
    assert len(examples) >= 3
    for command, promised in examples:
        quiet = [] if command.startswith("kvcentric sim cache") else ["--no-progress", "--no-plots"]
        result = subprocess.run([sys.executable, "-m", "kvcentric", *command.split()[1:], *quiet],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
        if promised:
            assert json.loads(result.stdout) == json.loads(promised)
    assert (tmp_path / "sim-out" / "summary.json").exists() and (tmp_path / "sim-colocated" / "summary.json").exists()


def test_a_low_priority_share_marks_that_share_of_requests(tmp_path):
    from kvcentric.tools.sim import SimConfig, workload
    config = SimConfig(workload="poisson", num_requests=400, low_priority_share=0.25, out=str(tmp_path))
    priorities = [r.priority for r in workload(config)]
    assert set(priorities) == {0, -1} and 0.18 < priorities.count(-1) / 400 < 0.32
    assert priorities == [r.priority for r in workload(config)]  # seeded


def test_lower_priority_is_rejected_first_at_cluster_scale():
    from factories import simple_cost
    from kvcentric.core.scheduling.config import SchedulerConfig
    from kvcentric.core.sim.cluster import ClusterSpec, Simulation
    from kvcentric.core.sim.metrics import summarize
    from kvcentric.core.sim.workload import poisson_workload
    requests = poisson_workload(rps=1.5, num_requests=300, input_len=1000, output_len=4, cache_ratio=0.0,
                                block_tokens=100, seed=2)
    for i, request in enumerate(requests):
        request.priority = -1 if i % 2 else 0
    sim = Simulation(SchedulerConfig(block_size=100, rejection="early", ttft_slo_s=5.0), simple_cost(),
                     ClusterSpec(prefill=1, decode=1, link_bytes_per_s=1e12))
    shares = summarize(sim.run(requests, sample_s=0), 5.0, 0.1)["rejected_share_by_priority"]
    assert shares["-1"] > shares["0"] + 0.1


def test_sim_runs_a_mixed_fleet_with_a_slower_decode_pool(trace, tmp_path):
    slow = tmp_path / "slow_decode.json"
    slow.write_text(json.dumps({"cost_model": {"prefill": [0.01, 1e-4, 0, 0], "decode": [0.08, 0, 0],
                                               "kv_bytes_per_token": 65536, "source": "slow"}}))
    out = tmp_path / "out"
    result = kvcentric("sim", "--trace", str(trace), "--prefill", "1", "--decode", "1", "--decode-profile",
                       str(slow), "--rejection", "never", "--out", str(out), "--no-plots", "--no-progress")
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pool_cost_models"]["decode"]["source"] == "slow" and "prefill" not in summary["pool_cost_models"]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert all(0.079 < r["tbt_s"] < 0.1 for r in rows if "tbt_s" in r and r["output_len"] > 1)  # the slow pool's steps


def test_sim_names_a_bad_pool_profile(trace, tmp_path):
    result = kvcentric("sim", "--trace", str(trace), "--prefill-profile", str(tmp_path / "none.json"),
                       "--out", str(tmp_path))
    assert result.returncode == 2 and "--prefill-profile" in result.stderr
