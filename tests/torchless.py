"""A pytest plugin that makes torch unimportable, so that a test which claims to need only the pure cores
proves it: `python -m pytest -p torchless ...` with tests/ on the path."""

from __future__ import annotations

import importlib.abc
import sys


class NoTorch(importlib.abc.MetaPathFinder):
    """Refuses torch and everything under it, as a machine without the `engine` extra would."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (torch is blocked by tests/torchless.py)")
        return None


for loaded in [name for name in sys.modules if name == "torch" or name.startswith("torch.")]:
    del sys.modules[loaded]
sys.meta_path.insert(0, NoTorch())
