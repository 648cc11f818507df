"""The documents stay what a newcomer can use: the README an overview, docs/performance.md a reference (the dated
runs live in the notebook beside it), every link and every code path they name present in the tree, and every
result kept in bench/results/ quoted by a document. It reads files; it does not judge what they say."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "performance-notebook.md"
DOCUMENTS = sorted({ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "bench").rglob("*.md"), *(ROOT / "deploy").rglob("*.md")})
REFERENCE = [path for path in DOCUMENTS if path != NOTEBOOK]
"""Every document but the notebook, whose dated runs name the paths of their day."""
CODE_ROOTS = ("libs/", "services/", "tests/", "bench/", "deploy/", "docs/", ".ci/")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
MAX_LINES = {"README.md": 150, "docs/performance.md": 500}
GENERATED = {"deploy/secure/out/"}
"""Paths a documented command writes, not kept in the tree."""


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def outside_code(text: str) -> str:
    """The text without its fenced blocks (a link in a code block is not a link)."""
    return re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", outside_code(path.read_text()), flags=re.M):
        base, n = slug(heading), 0
        while (candidate := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(candidate)
    return found


def links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(outside_code(path.read_text()))]


@pytest.mark.parametrize("document, limit", sorted(MAX_LINES.items()))
def test_the_overview_and_the_reference_stay_short(document, limit):
    lines = len((ROOT / document).read_text().splitlines())
    assert lines <= limit, f"{document} has {lines} lines, more than {limit}: move the detail to a page of docs/"


@pytest.mark.parametrize("document", DOCUMENTS, ids=name)
def test_every_link_resolves(document):
    broken = []
    for target in links(document):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        goal = (document.parent / file).resolve() if file else document
        if not goal.exists():
            broken.append(f"{target}: no such file")
        elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
            broken.append(f"{target}: no heading #{anchor} in {name(goal)}")
    assert not broken, f"{name(document)}: " + "; ".join(broken)


def code_paths(text: str) -> set[str]:
    """The paths under the checkout's top folders that a document names in backticks (globs and placeholders
    left out)."""
    named = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(".,:;)").split("::")[0]
        last = token.rstrip("/").rsplit("/", 1)[-1]
        path_like = token.endswith("/") or "." in last  # `deploy/decode` is a kubectl name, not a path
        if token.startswith(CODE_ROOTS) and path_like and not re.search(r"[*{}<>$]|\.\.\.", token):
            named.add(token.split("#")[0])
    return named


@pytest.mark.parametrize("document", REFERENCE, ids=name)
def test_every_code_path_named_exists(document):
    missing = sorted(path for path in code_paths(document.read_text()) - GENERATED if not (ROOT / path).exists())
    assert not missing, f"{name(document)} names paths that are not in the tree: {missing}"


def cited(result: Path, texts: list[str], globs: list[str]) -> bool:
    """Named (its JSON, PNG, markdown or log by its stem, or its folder), or matched by a glob a document names."""
    relative = result.relative_to(ROOT / "bench" / "results").as_posix()
    by_stem = re.compile(rf"(?<![\w.-]){re.escape(result.name.split('.')[0])}\.(?:json|jsonl|png|md|log)\b")
    if relative.count("/") and any(relative.split("/", 1)[0] + "/" in text for text in texts):
        return True
    siblings = {result.name} | {Path(result.name).with_suffix("." + g.rsplit(".", 1)[1]).name for g in globs}
    return any(by_stem.search(text) for text in texts) or any(fnmatch.fnmatch(s, g) for s in siblings for g in globs)


def test_every_result_kept_is_cited_by_a_document():
    texts = [path.read_text() for path in REFERENCE]
    globs = [token for text in texts for token in re.findall(r"\w[\w.\-]*\*[\w.\-*]*\.(?:json|jsonl|png|md|log)", text)]
    results = [path for path in (ROOT / "bench" / "results").rglob("*") if path.is_file()]
    uncited = sorted(name(path) for path in results if not cited(path, texts, globs))
    assert not uncited, f"results no document cites (cite them in docs/performance.md or remove them): {uncited}"


def test_the_results_the_reference_names_are_kept():
    named = set(re.findall(r"`([\w.\-]+\.(?:json|jsonl|png|log))`", (ROOT / "docs" / "performance.md").read_text()))
    kept = {path.name for path in (ROOT / "bench" / "results").rglob("*")}
    assert not named - kept, f"docs/performance.md names results not in bench/results/: {sorted(named - kept)}"
