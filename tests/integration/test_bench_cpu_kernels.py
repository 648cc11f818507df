"""`bench/engine/bench_cpu_kernels.py` runs end to end: every kernel timed beside torch's way (the small GEMM beside
`F.linear` and oneDNN's) per model shape and thread count, the ratios derived, the JSON written with the
instruction set the kernels were built for (or, without a compiler, a clear SKIPPED)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvcentric.engine.model import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_kernels_writes_every_figure(tmp_path):
    out = tmp_path / "cpu_kernels.json"
    done = subprocess.run([sys.executable, "-m", "bench.engine.bench_cpu_kernels", "--models", "tiny",
                           "--threads", "1", "--repeat", "2", "--budget-s", "0.2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    if kernels.compiler() is None:
        assert "SKIPPED" in done.stdout and not out.exists()
        return
    written = json.loads(out.read_text())
    assert written["isa"] == "native" and written["library"] in ("avx512", "avx2", "scalar", "portable")
    figures = written["results"]["1 thread(s)"]["tiny"]
    gemm = figures.pop("gemm")
    assert set(gemm) == {"qkv 64->128", "o 64->64", "gate_up 64->256", "down 128->64"}
    rows = written["gemm_rows"]
    for shape, cell in gemm.items():  # each figure a list over `gemm_rows`
        assert all(len(cell[key]) == len(rows) for key in ("kernel_ms", "F.linear_ms", "onednn_ms")), shape
        for kernel_ms, linear_ms, ratio in zip(cell["kernel_ms"], cell["F.linear_ms"], cell["kernel/F.linear"]):
            assert kernel_ms >= 0 and linear_ms >= 0, shape  # a 1-row GEMM of `tiny` can round to 0.0 ms
            assert linear_ms == 0 or ratio == round(kernel_ms / linear_ms, 3), shape
    assert len(figures) == 11  # 5 attention cases, 3 layer ops at 32 and 2048 rows
    for name, cell in figures.items():
        assert cell["kernel_ms"] > 0 and cell["torch_ms"] > 0, name
        assert cell["kernel/torch"] == round(cell["kernel_ms"] / cell["torch_ms"], 3), name
