"""What every benchmark shares: where results go, the machine record each result carries, the result's shape
(a `machine` block, `ratio` fields), and a `kvcentric up` cluster started for the length of a `with`. It
measures nothing itself and asserts nothing.

Benchmarks run as modules from the checkout's root, so that `bench` and the test harness (`tests/harness.py`)
import without touching `sys.path`:

    .venv/bin/python -m bench.serving.bench_vs_vllm --help
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path("bench") / "results"
"""Where results are written by default: `bench/results/` of the directory the bench runs from (the checkout's
root), so a copy run elsewhere writes beside itself."""
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "asimd", "sve")
"""The vector instruction sets that decide which kernels a CPU runs, as `lscpu` spells them."""


def lscpu() -> dict[str, str]:
    """`lscpu`'s fields (Model name, Flags, ...), else what /proc/cpuinfo says; empty where neither exists."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    found = {key.strip(): value.strip() for key, value in fields.items()}
    if "Model name" not in found:
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    found.setdefault("Model name", value.strip())
                elif key.strip() in ("flags", "Features"):
                    found.setdefault("Flags", value.strip())
    return found


def cpu_model() -> str:
    """The CPU's model name as `lscpu` gives it, else the architecture."""
    return lscpu().get("Model name") or platform.processor() or platform.machine()


def cpu_isa_flags() -> list[str]:
    """Which of the vector instruction sets in ISA_FLAGS the CPU has."""
    flags = set(lscpu().get("Flags", "").split())
    return [flag for flag in ISA_FLAGS if flag in flags]


def git_commit() -> str | None:
    """The checkout's commit (with `+dirty` when its tracked files differ), or None outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True, timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return (head.stdout.strip() + ("+dirty" if dirty else "")) if head.returncode == 0 else None


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def gpu_name() -> str | None:
    """The first CUDA device's name where torch sees one."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine() -> dict[str, Any]:
    """The machine record every result carries: the CPU as `lscpu` names it and its vector ISAs, the cores, the
    GPU if any, the software, the commit measured, and how busy the box was when it was taken."""
    return {"cpu": cpu_model(), "isa": cpu_isa_flags(), "cores": os.cpu_count(), "gpu": gpu_name(),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch_version(), "commit": git_commit(), "load_average": round(os.getloadavg()[0], 2),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def ratio(ours: float | None, baseline: float | None, digits: int = 3) -> float | None:
    """ours / baseline, the form every comparison in a result takes (a `ratio` field); None when either is
    missing or the baseline is zero."""
    if ours is None or not baseline:
        return None
    return round(ours / baseline, digits)


def record(bench: str, **fields: Any) -> dict[str, Any]:
    """A result: which bench wrote it, the machine it ran on (taken now), then the bench's own fields. A bench
    that compares puts `ratio` (ours / baseline) beside the two figures it divides."""
    return {"bench": bench, "machine": machine(), **fields}


def write(path: str | Path, result: dict[str, Any], indent: int = 1) -> Path:
    """Write a result as JSON, with a machine record if it has none yet; returns the path."""
    result = result if "machine" in result else {"machine": machine(), **result}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, default=str) + "\n")
    return path


def append_line(path: str | Path, result: dict[str, Any]) -> Path:
    """Append a result as one JSON line (the `.jsonl` files of alternated runs), with a machine record."""
    result = result if "machine" in result else {"machine": machine(), **result}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(result, default=str) + "\n")
    return path


@contextlib.contextmanager
def cluster(*flags: str, log_dir: str | None = None, timeout_s: float = 120.0,
            env: dict[str, str] | None = None) -> Iterator[Any]:
    """`kvcentric up FLAGS` as a child process, ready on entry and stopped on exit; yields the test harness's
    `UpProcess` (its `url`, `port`, `log_dir`)."""
    from tests.harness import UpProcess

    with contextlib.ExitStack() as stack:
        logs = log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvc-bench-"))
        up = UpProcess(logs, *flags, timeout_s=timeout_s, env=env)
        try:
            yield up
        finally:
            up.stop()


def __getattr__(name: str) -> Any:
    """`UpProcess` and `spawn_service`, the test harness's (`tests/harness.py`), imported on first use so that
    a bench that starts no server needs no checkout around it."""
    if name in ("UpProcess", "spawn_service"):
        from tests import harness

        return getattr(harness, name)
    raise AttributeError(name)
