"""The unit tests of the pure cores need no torch: every test file that imports `kvcentric.core` and nothing of
torch, the engine or a service is collected in a fresh interpreter where torch cannot be imported
(tests/torchless.py), so a helper that pulls torch in at the top (as tests/factories.py once did) fails here.
`make pure` runs those files in full the same way."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "kvcentric.engine", "kvc_")
"""Imports that make a test file more than a pure-core test."""


def imported(path: Path) -> set[str]:
    """Every absolute module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def pure_core_tests() -> list[Path]:
    found = []
    for path in sorted((TESTS / "unit").glob("test_*.py")):
        names = imported(path)
        if any(name.startswith("kvcentric.core") for name in names) and not any(
                name.startswith(HEAVY) for name in names):
            found.append(path)
    return found


def test_the_pure_core_tests_are_found():
    names = {path.name for path in pure_core_tests()}
    assert {"test_scheduling_policies.py", "test_block_pool.py", "test_sim_cluster.py"} <= names
    assert "test_model_and_engines.py" not in names


def test_the_pure_core_tests_are_collected_with_torch_blocked():
    files = [str(path) for path in pure_core_tests()]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "torchless",
                          "--collect-only", *files], cwd=TESTS.parent, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(TESTS)}, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "error" not in run.stdout.lower().splitlines()[-1], run.stdout[-2000:]


def test_torch_is_really_blocked():
    run = subprocess.run([sys.executable, "-c", "import torchless, importlib; importlib.import_module('torch')"],
                         env={**os.environ, "PYTHONPATH": str(TESTS)}, capture_output=True, text=True)
    assert run.returncode != 0 and "blocked by tests/torchless.py" in run.stderr

