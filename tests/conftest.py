"""What every test shares: tests/ on sys.path (factories, harness, waiting) and the project's shared folder."""

import fcntl
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The engines of the tests run every CPU kernel wherever it takes the tensors, as fast or slow as it is on this
# machine (the kernel choice, `engine/model/kernels/choice.py`, is tested on its own): the same paths on every machine.
os.environ.setdefault("KVC_KERNELS", "on")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared() -> Path:
    """The project's shared folder (traces, papers): $KVC_SHARED, else `shared` in the repository, else
    `shared` beside it (where a CI clone has it). It may be missing where the repository stands alone."""
    if os.environ.get("KVC_SHARED"):
        return Path(os.environ["KVC_SHARED"])
    inside = REPO / "shared"
    return inside if inside.is_dir() else REPO.parent / "shared"


@pytest.fixture(scope="session")
def kernel_builds(tmp_path_factory) -> Path:
    """A folder of this session holding the CPU kernels compiled once for every instruction set the tests build
    (`portable`, `avx2`, `avx512`, compiled whatever this CPU runs, and `avx512-emulated` where this CPU has no
    AVX-512 and SIMDe's headers are found), side by side, in parallel (with `native`, into the cache the engines
    use). `kernels.build(folder, isa)` returns a build
    already there (the folder is its cache), so test_cpu_isa and test_cpu_kernels compile each once, not once
    each (a build is seconds of compiler time)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs the suite on workers: they share one folder
        directory = tmp_path_factory.getbasetemp().parent / "kernels"
        directory.mkdir(exist_ok=True)
    else:
        directory = tmp_path_factory.mktemp("kernels")
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker that comes second waits for the first's builds, and finds them
        build_every_isa(directory)
    return directory


def build_every_isa(directory: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvcentric.engine.model import kernels
    from kvcentric.engine.model.kernels import isas

    names = ["avx512", "avx2", "portable"]
    try:
        isas.check_cpu(kernels.EMULATED)
        emulable = "avx512" not in kernels.runnable() and kernels.simde_version() is not None
    except kernels.UnsupportedIsa:
        emulable = False
    if emulable:
        names.insert(0, kernels.EMULATED)  # the longest, first
    with ThreadPoolExecutor(len(names) + 1) as pool:
        futures = [pool.submit(kernels.build, directory, name) for name in names]
        futures.append(pool.submit(kernels.build, None, "native"))  # the engines' cache, built there once
        for future in futures:
            try:
                future.result()
            except RuntimeError:
                pass  # a build that fails here fails again, and says why, where a test asks for it
