"""The package's layering holds: every import (at module level or inside a function; ``if TYPE_CHECKING:``
imports, which never run, aside) points down the layers of docs/architecture.md, guest/ imports nothing from
the node, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "aenv_node"

#: a package may import packages of a lower rank only (``(top)`` is ``aenv_node/__init__``: the version)
RANK = {"(top)": -1, "guest": 0, "config": 0, "faults": 0, "netns": 0, "state": 1, "storage": 2, "vmm": 2, "net": 2, "images": 2, "dataplane": 3,
        "snapshot": 4, "templates": 5, "runtime": 6, "api": 7, "cluster": 8, "cli": 9}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every aenv_node module this file imports, anywhere in it."""
    mod = _module(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in block.body for n in ast.walk(stmt)}  # annotations only: never executed
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("aenv_node"):
                for a in node.names:  # `from pkg import mod` imports the module; `from mod import name` mod
                    sub = f"{target}.{a.name}"
                    out.add(sub if (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                            or (ROOT.parent / Path(*sub.split(".")) / "__init__.py").exists() else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("aenv_node"))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        for target in _imports(path):
            while target not in files and "." in target:  # `from pkg.mod import name`: the module
                target = target.rsplit(".", 1)[0]
            if target in files and target != mod:
                graph[mod].add(target)
    return graph


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "(top)"


def test_imports_point_down_the_layers() -> None:
    graph = _graph()
    assert len(graph) > 50  # the walk found the package
    upward = sorted((m, t) for m, ts in graph.items() for t in ts
                    if _package(m) != _package(t) and RANK[_package(t)] >= RANK[_package(m)]
                    and not (_package(t) == "guest" and t == "aenv_node.guest"))  # the envd version is data
    assert upward == []
    guest_out = sorted((m, t) for m, ts in graph.items() if _package(m) == "guest" for t in ts
                       if _package(t) != "guest")
    assert guest_out == []


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            # a package's __init__ re-exporting its modules is not a cycle with them
            if w == v.rsplit(".", 1)[0] and v.startswith(w + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []
