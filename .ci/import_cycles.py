"""Fails when any two modules of the library or the services import each other, directly or through others.

It reads the import graph that import-linter builds (grimp) and reports each cycle once; it does not judge layers.
"""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("kvcentric", "kvc_gateway", "kvc_conductor", "kvc_prefill", "kvc_decode", "kvc_colocated",
            "kvc_kvs_meta", "kvc_messenger")


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The groups of modules that reach each other through imports (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == module:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
            elif step in on_stack:
                low[module] = min(low[module], index[step])
    return groups


def describe(graph: grimp.ImportGraph, group: list[str]) -> str:
    """The imports that close the group, with the line of each."""
    members = set(group)
    lines = [f"cycle among {', '.join(group)}:"]
    for importer in group:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            where = ", ".join(f"l.{d['line_number']}" for d in details)
            lines.append(f"  {importer} -> {imported} ({where})")
    return "\n".join(lines)


def main() -> int:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    groups = strongly_connected(graph)
    for group in groups:
        print(describe(graph, group))
    print(f"import cycles: {len(groups)} among {len(graph.modules)} modules")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())
