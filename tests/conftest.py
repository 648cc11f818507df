"""What every test shares: tests/ on sys.path (factories, harness, waiting) and the project's shared folder."""

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
