"""pyproject.toml lists every package, so a non-editable install (the Docker images) has all the code."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_library_package_is_listed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT / "libs").parts) for p in (ROOT / "libs").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_every_service_folder_is_a_mapped_package():
    mapped = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    services = {f"services/{p.name}" for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}
    assert services <= mapped, f"map in [tool.setuptools.package-dir]: {sorted(services - mapped)}"
