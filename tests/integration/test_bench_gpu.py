"""`bench/engine/bench_gpu.py` runs end to end on the CPU with a tiny model (its GPU run is
`bench/engine/gpu_check.sh`): every
section measured, the ratios derived, the JSON and markdown written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "bench.engine.bench_gpu", "--device", "cpu", "--dtype",
                           "float32", "--model", "tiny", "--prefill", "32", "64", "--prefill-many", "2x16",
                           "--prefix-chunks", "24:16", "--batches", "1", "3", "--context",
                           "40", "--steps", "2", "--warmup", "1", "--repeat", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    assert result["ceilings"]["matmul"]["flops"] > 0 and result["ceilings"]["copy"]["bytes_per_s"] > 0
    for row in result["prefill"]:
        assert row["ours_ms"] > 0 and 0 < row["ours_share_of_peak"] and row["transformers_ms"] > 0
    more = {row["shape"]: row for row in result["prefill_more"]}
    assert set(more) == {"2 x 16 prompts, one pass", "16 after 24 cached"}
    for row in more.values():
        assert row["ours_ms"] > 0 and 0 < row["ours_share_of_peak"]
    # a chunk after a prefix costs more than the same chunk alone, less than the whole prompt
    alone = next(r for r in result["prefill"] if r["tokens"] == 32)["flops"] / 2
    assert alone < more["16 after 24 cached"]["flops"] < 2 * alone * 40 / 16
    for row in result["decode"]:
        assert row["ours_ms"] > 0 and row["floor_ms"] > 0 and row["ours_over_floor"] > 0
        assert row["transformers_ms"] > 0
    assert "eager" not in result["skipped"]  # no --eager-too asked for
    table = out.with_suffix(".md").read_text()
    assert "| batch | floor ms |" in table and "cpu" in table and "16 after 24 cached" in table
