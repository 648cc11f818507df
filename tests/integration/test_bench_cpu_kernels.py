"""`bench/bench_cpu_kernels.py` runs end to end: every kernel timed beside torch's way (the small GEMM beside
oneDNN's), the ratios derived, the JSON written (or, without a compiler, a clear SKIPPED)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvcentric.engine import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_kernels_writes_every_figure(tmp_path):
    out = tmp_path / "cpu_kernels.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cpu_kernels.py"), "--repeat", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    if kernels.compiler() is None:
        assert "SKIPPED" in done.stdout and not out.exists()
        return
    results = json.loads(out.read_text())["results"]
    assert len(results) == 18  # 5 attention cases, 3 layer ops at 32 and 2048 rows, a step's linears at 7 row counts
    for name, figures in results.items():
        assert figures["kernel_ms"] > 0 and figures["torch_ms"] > 0, name
        assert figures["ratio"] == round(figures["torch_ms"] / figures["kernel_ms"], 2)
    assert "| decode, 32 x 288, KV in cache |" in done.stdout
    assert "| decode step's linear layers, 16 rows (torch: oneDNN) |" in done.stdout
