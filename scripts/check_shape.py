#!/usr/bin/env python3
"""The package's shape against the house limits: module, class and function sizes, import cycles.

Usage: scripts/check_shape.py [--max-module 500] [--max-class 300] [--max-function 60]
Prints every offender and exits 1 if there is one. Counts physical lines of each definition
(decorators excluded, docstrings included). Import cycles are found among all imports
between ``lmcache_p2p`` modules, lazy ones inside functions included (not those under ``TYPE_CHECKING``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "lmcache_p2p"


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


def _imports(tree: ast.Module, module: str, is_pkg: bool, known: set[str]) -> set[str]:
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
        if name and name.startswith(PACKAGE):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--max-module", type=int, default=500)
    ap.add_argument("--max-class", type=int, default=300)
    ap.add_argument("--max-function", type=int, default=60)
    args = ap.parse_args()
    root = Path(args.root)
    files = sorted((root / PACKAGE).rglob("*.py"))
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
        graph[name] = _imports(tree, name, path.name == "__init__.py", known) - {name}
    for comp in _cycles(graph):
        problems.append("cycle    " + " <-> ".join(comp))
    for p in problems:
        print(p)
    print(f"{len(problems)} over the limits (module {args.max_module}, class {args.max_class}, "
          f"function {args.max_function} lines; import cycles)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
