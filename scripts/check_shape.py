#!/usr/bin/env python3
"""The package's shape against the house limits: module, class and function sizes, import cycles, and
two-way ties between the parts of a layered package.

Usage: scripts/check_shape.py [--max-module 500] [--max-class 300] [--max-function 60]
Prints every offender and exits 1 if there is one. Counts physical lines of each definition
(decorators excluded, docstrings included). Import cycles are found among all imports
between ``lmcache_p2p`` modules, lazy ones inside functions included (not those under ``TYPE_CHECKING``);
each is printed as one closed path. A tie: two direct parts (subpackage or module) of a layered package
(``--layered``, ``lmcache_p2p.proxy`` by default) where each imports the other, by any of their modules;
the parts of a layered package must form layers, so its dependencies go one way.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "lmcache_p2p"
LAYERED = ("lmcache_p2p.proxy",)


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_pkg: bool, known: set[str], package: str = PACKAGE) -> set[str]:
    found: set[str] = set()

    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skipped.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            for a in node.names:
                found.add(f"{mod}.{a.name}")
    out = set()
    for name in found:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and (name == package or name.startswith(package + ".")):
            out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


def _path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One closed import path through the strongly connected ``comp``: its first module back to itself."""
    inside = set(comp)
    start = comp[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to ``start``
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _part(layered: str, module: str) -> str | None:
    """The direct part (subpackage or module) of ``layered`` that ``module`` belongs to."""
    if not module.startswith(layered + "."):
        return None
    return module[len(layered) + 1:].split(".")[0]


def _ties(graph: dict[str, set[str]], layered: str) -> list[str]:
    """Pairs of parts of ``layered`` that import each other, each with one import of either way."""
    edges: dict[tuple[str, str], tuple[str, str]] = {}
    for src in sorted(graph):
        a = _part(layered, src)
        if a is None:
            continue
        for dst in sorted(graph[src]):
            b = _part(layered, dst)
            if b is not None and b != a:
                edges.setdefault((a, b), (src, dst))
    out = []
    for (a, b), (src, dst) in sorted(edges.items()):
        if a < b and (b, a) in edges:
            back_src, back_dst = edges[(b, a)]
            out.append(f"tie      {layered}: {a} <-> {b} ({src} -> {dst}; {back_src} -> {back_dst})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--package", default=PACKAGE, help="the package to check (a folder under --root)")
    ap.add_argument("--layered", action="append", default=None,
                    help=f"a package whose direct parts must not import each other both ways (default {LAYERED})")
    ap.add_argument("--max-module", type=int, default=500)
    ap.add_argument("--max-class", type=int, default=300)
    ap.add_argument("--max-function", type=int, default=60)
    args = ap.parse_args(argv)
    root = Path(args.root)
    files = sorted((root / args.package).rglob("*.py"))
    names = {_module_name(root, f): f for f in files}
    known = set(names)
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        rel = path.relative_to(root)
        if lines > args.max_module:
            problems.append(f"module   {lines:5d} lines  {rel}")
        for node in ast.walk(tree):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > args.max_class:
                problems.append(f"class    {size:5d} lines  {rel}:{node.lineno} {node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > args.max_function:
                problems.append(f"function {size:5d} lines  {rel}:{node.lineno} {node.name}")
        graph[name] = _imports(tree, name, path.name == "__init__.py", known, args.package) - {name}
    for comp in _cycles(graph):
        problems.append("cycle    " + " -> ".join(_path(graph, comp)))
    for layered in args.layered if args.layered is not None else LAYERED:
        problems.extend(_ties(graph, layered))
    for p in problems:
        print(p)
    print(f"{len(problems)} over the limits (module {args.max_module}, class {args.max_class}, "
          f"function {args.max_function} lines; import cycles; two-way ties between the parts of "
          f"{', '.join(args.layered if args.layered is not None else LAYERED)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
