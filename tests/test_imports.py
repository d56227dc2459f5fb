"""Every module of the package imports on its own, in any order, and no module-level import is circular.

(a) imports all modules in fresh interpreters, each in a seeded random order: a module
that only imports because another one happened to be imported first fails here. (b)
builds the package's import graph from the source (``ast``: module-level imports,
including those under ``if``/``try`` and in class bodies; not those inside functions nor
under ``if TYPE_CHECKING``) and fails on a cycle, naming it with the import lines.
Implicit imports of parent packages are not edges (Python starts a package's
``__init__`` before its submodules, and an ``__init__`` importing its own submodules is
no cycle); ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg`` itself, whose ``__init__`` must then have run.
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "boost_compiler"
SEEDS = (0, 1, 2)

Graph = dict[str, dict[str, int]]  # module -> {imported module: line}


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``), ``__main__`` modules left out."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue  # running the command is what importing it does
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs when called
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _module_level_imports(node.body)
            found += _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _module_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
            found += _module_level_imports(node.body)
    return found


def _targets(
    name: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if node.level:
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in known else source)
    return [t for t in out if t in known]


def import_graph(package: Path = PACKAGE) -> Graph:
    mods = modules(package)
    graph: Graph = {}
    for name, (path, is_pkg) in mods.items():
        edges: dict[str, int] = {}
        for node in _module_level_imports(ast.parse(path.read_text(), str(path)).body):
            for target in _targets(name, is_pkg, node, set(mods)):
                if target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def describe(cycle: list[str], graph: Graph) -> str:
    files = modules()
    lines = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        path = files[a][0].relative_to(ROOT) if a in files else a
        lines.append(f"  {a} imports {b} ({path}:{graph[a][b]})")
    return "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(lines)


def test_the_package_has_no_module_level_import_cycle() -> None:
    graph = import_graph()
    assert "boost_compiler.passes" in graph["boost_compiler.backend"]  # the graph is real
    cycle = find_cycle(graph)
    assert cycle is None, describe(cycle, graph)


def test_the_cycle_finder_sees_cycles_and_skips_function_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
        "def f():\n    from . import a\nB = 2\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import A\n")  # the package's __init__ itself
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a": 1}, "pkg.a": {"pkg.b": 1}, "pkg.b": {}, "pkg.sub": {},
                     "pkg.sub.c": {"pkg": 1}}  # fmt: skip
    assert find_cycle(graph) is None
    (pkg / "b.py").write_text("from .sub.c import *\nB = 2\n")
    assert find_cycle(import_graph(pkg)) == ["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg"]


_IMPORT_ALL = """
import importlib, json, sys, traceback
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except BaseException:
        print(f"importing {name} failed:")
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.mark.parametrize("seed", SEEDS)
def test_every_module_imports_in_a_random_order(seed: int) -> None:
    """A fresh interpreter imports every module, in an order drawn from ``seed``."""
    order = sorted(modules())
    random.Random(seed).shuffle(order)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(order)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"order (seed {seed}): {order}\n{proc.stdout}\n{proc.stderr}"
