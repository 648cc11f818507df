"""The file map of docs/architecture.md names every module under libs/ and services/, and nothing else, so it
cannot fall behind the tree. It reads the table; it does not judge what the rows say."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def file_map_rows() -> list[str]:
    """The module of each row of the table under the `## File map` heading, in the order written."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## File map\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.M)


def modules_in_tree() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for top in ("libs", "services") for path in (ROOT / top).rglob("*.py")}


def test_the_file_map_lists_every_module_once():
    rows = file_map_rows()
    assert len(rows) == len(set(rows)), sorted({row for row in rows if rows.count(row) > 1})


def test_the_file_map_is_the_tree():
    listed, present = set(file_map_rows()), modules_in_tree()
    assert not present - listed, f"modules missing from docs/architecture.md's file map: {sorted(present - listed)}"
    assert not listed - present, f"file map rows of modules that are gone: {sorted(listed - present)}"
