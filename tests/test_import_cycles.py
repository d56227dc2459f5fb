"""No import circle in the package (issue 27, item 5), counting every import statement.

An AST walk of every module under ``boost_compiler/``: module-level imports, imports inside
functions (the usual way to hide a circle) and those under ``TYPE_CHECKING`` alike. An
edge ``a -> b`` for each ``import b``/``from b import x`` (and ``from a import b`` when
``b`` is a module); a package's ``__init__`` is a module like any other. Any strongly
connected set of more than one module, or a module importing itself, is a circle.

The same walk, one level up (issue 43, item 1): each subpackage and each root module is a
layer (``boost_compiler.tp.rules.core`` is in ``tp``, ``boost_compiler.backend`` is
``backend``, the package's ``__init__`` is ``boost_compiler``), and no circle may join two
layers either: the compiler's stages, the backend and the user-facing ``parallel`` import
downward only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import boost_compiler

ROOT = Path(boost_compiler.__file__).parent
PKG = "boost_compiler"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            subs = {f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in modules}
            out |= subs
            if len(subs) < len(node.names):  # a name the module (or package) defines
                out.add(src)
    return {m for m in out if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> str:
    """The subpackage or root module ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``a -> b`` when a module of layer ``a`` imports one of layer ``b`` (``a != b``)."""
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        out.setdefault(layer(src), set()).update(
            layer(t) for t in targets if layer(t) != layer(src)
        )
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_check_sees_a_circle_hidden_in_a_function(tmp_path: Path) -> None:
    """A package whose circle hides in a function and under TYPE_CHECKING: both found."""
    pkg = tmp_path / "boost_compiler"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def g():\n    from ..c import h\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        "d.py": "from .sub import b\n",  # reads the circle, not in it
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    modules = {f"{PKG}.{m}": pkg / f"{m.replace('.', '/')}.py" for m in ("a", "c", "d", "sub.b")}
    modules |= {PKG: pkg / "__init__.py", f"{PKG}.sub": pkg / "sub" / "__init__.py"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert circles(graph) == [[f"{PKG}.a", f"{PKG}.c", f"{PKG}.sub.b"]], graph


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 90 and any(graph.values())
    found = circles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_check_sees_two_layers_importing_each_other() -> None:
    """No module circle, yet ``ir`` and ``tp`` import each other: a layer circle."""
    graph = {
        f"{PKG}.ir.capture": {f"{PKG}.tp.placeholder"},
        f"{PKG}.tp.placeholder": set(),
        f"{PKG}.tp.apply": {f"{PKG}.ir.ops"},
        f"{PKG}.ir.ops": set(),
        f"{PKG}.backend": {f"{PKG}.tp.apply"},
    }
    assert not circles(graph)
    assert circles(layer_graph(graph)) == [["ir", "tp"]]


def test_no_two_layers_import_each_other() -> None:
    """Subpackages and root modules import downward only (function-level imports count)."""
    layers = layer_graph(import_graph())
    assert {"parallel", "tp", "ir", "passes", "backend"} <= layers.keys()
    assert "backend" in layers["parallel"] and "parallel" not in layers["backend"]
    found = circles(layers)
    assert not found, "layers importing each other: " + "; ".join(" <-> ".join(c) for c in found)
