"""`kvcentric bench replay` against a running `kvcentric up`: a small Mooncake-format trace and a Poisson
workload become real requests, and the run leaves requests.jsonl, summary.json and the CDF plot."""

from __future__ import annotations

import json
import subprocess
import sys

SUMMARY_KEYS = {"requests", "completed", "completed_within_slo", "rejected_before_prefill",
                "rejected_after_prefill", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p50_s",
                "tbt_p90_s", "tbt_p99_s", "slo_attainment", "goodput_rps", "prefix_hit_ratio", "rejected_429"}


def write_trace(path) -> None:
    """Eight requests in 0.7 s; all share hash id 0, pairs share ids 1 and 2 as well (conversation turns)."""
    with open(path, "w") as trace:
        for i in range(8):
            ids = [0, 1 + i // 2, 10 + i // 2, 100 + i]
            trace.write(json.dumps({"timestamp": 100 * i, "input_length": 2000, "output_length": 40,
                                    "hash_ids": ids}) + "\n")


def replay(cluster, out, *flags: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "kvcentric", "bench", "replay", *flags, "--url", cluster.url,
                             "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_trace_replays_with_shared_prefixes_into_summary_requests_and_plot(cluster, tmp_path):
    write_trace(tmp_path / "trace.jsonl")
    shown = replay(cluster, tmp_path / "run", str(tmp_path / "trace.jsonl"), "--speed", "2", "--scale", "16",
                   "--output-scale", "8", "--label", "tiny-1p1d")
    assert shown["requests"] == 8 and shown["completed"] == 8 and shown["rejected_429"] == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary) and summary["label"] == "tiny-1p1d"
    rows = [json.loads(line) for line in open(tmp_path / "run" / "requests.jsonl")]
    assert [r["prompt_tokens"] for r in rows] == [125] * 8 and all(r["completion_tokens"] == 5 for r in rows)
    assert all(r["status"] == "completed" and r["ttft_s"] > 0 for r in rows)
    assert (tmp_path / "run" / "ttft_tbt_cdf.png").stat().st_size > 10_000


def test_a_poisson_workload_replays_too(cluster, tmp_path):
    shown = replay(cluster, tmp_path / "poisson", "poisson", "--rps", "20", "--num-requests", "6",
                   "--input-len", "256", "--output-len", "3", "--cache-ratio", "0.5", "--no-plots")
    assert shown["requests"] == 6 and shown["completed"] == 6
    rows = [json.loads(line) for line in open(tmp_path / "poisson" / "requests.jsonl")]
    assert all(r["prompt_tokens"] == 256 and r["completion_tokens"] == 3 for r in rows)
