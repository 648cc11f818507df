"""`bench/serving/bench_security.py` runs end to end on a small KV push: plaintext gRPC and mutual TLS, each measured
(bytes per second, the first call on a new channel), their ratio derived and the JSON written. The TTFT half starts
two clusters (`kvcentric up` and `up --secure`); tests/integration/test_security.py covers the secured one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_security_measures_plain_and_mutual_tls_kv_pushes(tmp_path):
    out = tmp_path / "security.json"
    done = subprocess.run([sys.executable, "-m", "bench.serving.bench_security", "--skip-ttft", "--total-mib",
                           "8", "--layer-mib", "2", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    kv = json.loads(out.read_text())["kv"]
    assert set(kv["summary"]) == {"plain", "mtls"} and kv["total_bytes"] == 8 << 20
    for mode in ("plain", "mtls"):
        assert kv["summary"][mode]["median_bytes_s"] > 0 and kv["summary"][mode]["median_first_call_s"] > 0
    assert kv["mtls_over_plain_median_bytes_s"] > 0
