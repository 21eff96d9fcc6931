"""Draw the project's import graph, folder by folder: for each package, which of its children
import which, drawn top-down in layers (a child imports only children on the rows below it, so
a loop or an import running back up would show as an arrow pointing up, marked `^`).

    python bench/tools/import_graph.py            # every package, as text
    python bench/tools/import_graph.py engine     # one package
    python bench/tools/import_graph.py --dot > imports.dot   # Graphviz, for `dot -Tsvg`

`make lint` keeps the rules (pyproject.toml, [tool.importlinter]); this shows the shape.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import grimp

ROOTS = ("server", "engine", "kernels", "config")


def child_edges(graph: grimp.ImportGraph, package: str) -> dict[str, dict[str, int]]:
    """importer child -> imported child -> number of module imports, among `package`'s children."""
    children = sorted(graph.find_children(package))
    edges: dict[str, dict[str, int]] = {c: {} for c in children}
    for a in children:
        a_modules = {a} | graph.find_descendants(a)
        for b in children:
            if a == b:
                continue
            b_modules = {b} | graph.find_descendants(b)
            n = sum(
                1
                for m in a_modules
                for i in graph.find_modules_directly_imported_by(m)
                if i in b_modules
            )
            if n:
                edges[a][b] = n
    return edges


def layers(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Rows, top first: each child sits one row above the lowest of those it imports (a loop's
    members share the row the first of them reaches)."""
    depth: dict[str, int] = {}

    def height(node: str, seen: frozenset[str]) -> int:
        if node not in depth:
            below = [height(b, seen | {node}) for b in edges[node] if b not in seen | {node}]
            depth[node] = 1 + max(below, default=-1)
        return depth[node]

    for node in edges:
        height(node, frozenset())
    rows: dict[int, list[str]] = defaultdict(list)
    for node, d in depth.items():
        rows[d].append(node)
    return [sorted(rows[d]) for d in sorted(rows, reverse=True)]


def short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def draw_text(graph: grimp.ImportGraph, package: str) -> list[str]:
    edges = child_edges(graph, package)
    if not edges:
        return []
    rows = layers(edges)
    row_of = {node: i for i, row in enumerate(rows) for node in row}
    lines = [f"{package}/"]
    for row in rows:
        lines.append("  " + "   ".join(short(n) for n in row))
        for node in row:
            targets = [
                short(b) + ("^" if row_of[b] <= row_of[node] else "")
                for b in sorted(edges[node], key=lambda b: (row_of[b], b))
            ]
            if targets:
                lines.append(f"      {short(node)} -> {', '.join(targets)}")
    return lines


def draw_dot(graph: grimp.ImportGraph, packages: list[str]) -> list[str]:
    lines = ["digraph imports {", "  rankdir=TB; node [shape=box, fontname=monospace];"]
    for package in packages:
        for a, targets in child_edges(graph, package).items():
            for b, n in targets.items():
                lines.append(f'  "{a}" -> "{b}" [label="{n}"];')
    lines.append("}")
    return lines


def packages_under(graph: grimp.ImportGraph, roots: list[str]) -> list[str]:
    """The roots and every package below them (a package: a module with children)."""
    found = []
    for root in roots:
        for module in sorted({root} | graph.find_descendants(root)):
            if graph.find_children(module):
                found.append(module)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", default=list(ROOTS))
    parser.add_argument("--dot", action="store_true", help="Graphviz instead of text")
    args = parser.parse_args()
    graph = grimp.build_graph(*ROOTS)
    packages = packages_under(graph, args.packages)
    if args.dot:
        print("\n".join(draw_dot(graph, packages)))
        return
    top = [
        f"{r} -> {', '.join(sorted(i for i in ROOTS if i != r and graph.direct_import_exists(importer=r, imported=i, as_packages=True)))}"
        for r in ROOTS
    ]
    print("top level:\n  " + "\n  ".join(top) + "\n")
    for package in packages:
        lines = draw_text(graph, package)
        if lines:
            print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
