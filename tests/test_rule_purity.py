"""The sharding rules decide and never rewrite (issue 27, item 1).

Every module under ``boost_compiler/tp/rules/`` is read as code (AST): no assignment to
an attribute or an item of anything (``node.args = ...``, ``node.meta[...] = ...``), no
call of a method that changes an FX graph or node, no reach into a graph
(``.graph``/``.owning_module``), and no name of the planner's or the applier's private
state. The check is shown to fail on a module that breaks each of these.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import boost_compiler

RULES = Path(boost_compiler.__file__).parent / "tp" / "rules"
# What changes a graph or a node: fx.Graph's and fx.Node's mutating methods.
MUTATORS = {
    "replace_input_with", "replace_all_uses_with", "erase_node", "inserting_before",
    "inserting_after", "call_function", "call_method", "call_module", "create_node",
    "placeholder", "get_attr", "output", "lint", "recompile", "eliminate_dead_code",
    "update_arg", "update_kwarg", "prepend", "append", "insert_arg", "_remove_from_list",
}  # fmt: skip
# Nodes' and graphs' own attributes that hold a graph; a rule receives neither.
GRAPH_ATTRS = {"graph", "owning_module"}
# Containers' mutating methods: allowed only on a value the rule made itself.
LOCAL_LIST_METHODS = {
    "append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear",
    "remove", "discard",
}  # fmt: skip
MUTATORS |= LOCAL_LIST_METHODS


def violations(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    found: list[str] = []
    # The module's own tables (the registry's rules by kind) are its state, not a graph's.
    own = {t.id for stmt in tree.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
           for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
           if isinstance(t, ast.Name)}  # fmt: skip
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        local = _bound_names(fn) | own
        for node in ast.walk(fn):
            line = f"{where}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in _stores(targets):
                    if isinstance(t, (ast.Attribute, ast.Subscript)) and not _local(t, local):
                        found.append(f"{line}: assigns to {ast.unparse(t)}")
            elif isinstance(node, ast.Delete):
                found.append(f"{line}: deletes {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name in MUTATORS and not (
                    name in LOCAL_LIST_METHODS and _local(node.func.value, local)
                ):
                    found.append(f"{line}: calls .{name}()")
            elif isinstance(node, ast.Attribute) and node.attr in GRAPH_ATTRS:
                found.append(f"{line}: reads .{node.attr}")
    return found


def _stores(targets: list[ast.expr]) -> list[ast.expr]:
    """The expressions stored into, unpacking tuple targets (not walking into indexes)."""
    out: list[ast.expr] = []
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            out.extend(_stores(list(t.elts)))
        elif isinstance(t, ast.Starred):
            out.extend(_stores([t.value]))
        else:
            out.append(t)
    return out


def _bound_names(fn: ast.AST) -> set[str]:
    """Names a function binds itself (assigned, looped over, comprehended), and its
    parameters annotated as the strategy it is building: its own values."""
    names: set[str] = set()
    if not isinstance(fn, ast.Lambda):
        for a in fn.args.args + fn.args.kwonlyargs:
            if a.annotation is not None and ast.unparse(a.annotation) == "Strategy":
                names.add(a.arg)
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _local(expr: ast.AST, local: set[str]) -> bool:
    """Whether ``expr`` is (an attribute or item of) a value the function made itself."""
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return isinstance(expr, ast.Name) and expr.id in local


def test_no_rule_module_changes_a_graph() -> None:
    files = sorted(RULES.glob("*.py"))
    assert len(files) >= 8, files
    found = [v for f in files for v in violations(f.read_text(), f.name)]
    assert found == []


@pytest.mark.parametrize(
    "body",
    [
        "def r(ctx, node):\n    node.args = (1,)",
        "def r(ctx, node):\n    node.meta['x'] = 1",
        "def r(ctx, node):\n    node.replace_input_with(node.args[0], node)",
        "def r(ctx, node):\n    with node.graph.inserting_after(node):\n        pass",
        "def r(ctx, node):\n    g = node.graph",
        "def r(ctx, node):\n    ctx.env[node] = 1",
        "def r(ctx, node):\n    node.users.clear()\n    node.users.pop(node)",
        "def r(ctx, node):\n    del node.meta['x']",
    ],
)
def test_the_check_finds_a_rule_that_rewrites(body: str) -> None:
    assert violations(body, "toy.py"), body


def test_a_rule_may_build_its_own_strategy() -> None:
    ok = (
        "def r(ctx, node):\n    s = Strategy()\n    s.out = 1\n    s.fix[node] = 2\n"
        "    seen = []\n    seen.append(node)\n    return s"
    )
    assert violations(ok, "toy.py") == []
