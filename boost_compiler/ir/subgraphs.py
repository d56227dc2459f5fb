"""Nested compile regions in a dynamo graph: find the calls, read their bodies, inline them.

``torch.compiler.nested_compile_region`` reaches a backend as ``invoke_subgraph(body,
identifier, *operands)`` nodes whose ``body`` is a ``get_attr`` of a GraphModule shared by
every call of the region, followed by ``getitem`` nodes for its outputs; torch traces,
differentiates and lowers each body once, keyed by ``identifier``. Invariant: what
:func:`inline_call` leaves computes the same values as the call it replaces (the body's
nodes copied with its placeholders bound to the operands), so inlining is always an exact
way out where a body cannot be kept.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

INVOKE = torch.ops.higher_order.invoke_subgraph
_SIZE_METHODS = ("size", "dim", "stride")


def is_call(node: fx.Node) -> bool:
    """Whether ``node`` calls a nested compile region."""
    return node.op == "call_function" and node.target is INVOKE


def calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_call(n)]


def body_of(node: fx.Node) -> fx.GraphModule:
    """The GraphModule a region call runs."""
    gm = node.graph.owning_module
    assert gm is not None, "a region call outside a GraphModule"
    return getattr(gm, node.args[0].target)


def body_nodes(node: fx.Node) -> list[list[fx.Node] | None]:
    """The nodes of each module a higher-order op's ``get_attr`` arguments name (a custom
    ``autograd.Function``'s forward and backward bodies), in order; None for one that is
    not a GraphModule."""
    gm = node.graph.owning_module
    found = [getattr(gm, a.target, None) for a in node.args if _is_attr(a)]
    return [list(b.graph.nodes) if isinstance(b, fx.GraphModule) else None for b in found]


def _is_attr(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and arg.op == "get_attr"


def operands(node: fx.Node) -> tuple[Any, ...]:
    """What a region call passes its body's placeholders, in order."""
    return tuple(node.args[2:])


def inline_call(
    gm: fx.GraphModule,
    call: fx.Node,
    first_operand: int = 2,
    tag: Callable[[fx.Node], None] | None = None,
) -> None:
    """Replace ``call`` by a copy of its body's nodes, bound to its operands (exact).

    ``first_operand``: where the operands start in ``call.args`` (2 for ``invoke_subgraph``,
    1 for ``tag_activation_checkpoint``); ``tag`` sees every copied node.
    """
    graph = gm.graph
    body: fx.GraphModule = getattr(gm, call.args[0].target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = dict(zip(placeholders, call.args[first_operand:], strict=True))
    outputs: Any = None
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = fx.node.map_arg(node.args[0], env.__getitem__)
                break
            if node.op == "get_attr":  # a nested region's body: move it to the outer module
                name = free_name(gm, f"{call.args[0].target}_{node.target}")
                gm.register_module(name, getattr(body, node.target))
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
                continue
            new = graph.node_copy(node, env.__getitem__)
            new.meta = dict(node.meta)
            if tag is not None:
                tag(new)
            env[node] = new
    drop_dead_size_queries(graph)
    for user in list(call.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    if call.users:  # used as a whole (a single output)
        call.replace_all_uses_with(outputs)
    graph.erase_node(call)


def inline_all(
    gm: fx.GraphModule, tag_for: Callable[[fx.Node], Callable[[fx.Node], None]] | None = None
) -> int:
    """Inline every region call, nested ones and those inside other bodies (checkpoint
    regions) too; returns how many were inlined. ``tag_for(call)``, when given, returns
    the ``tag`` of :func:`inline_call` for that call's copied nodes (top graph only)."""
    n = sum(inline_all(sub) for sub in gm.children() if isinstance(sub, fx.GraphModule))
    while found := calls(gm.graph):
        for call in found:
            inline_call(gm, call, tag=tag_for(call) if tag_for is not None else None)
            n += 1
    if n:
        drop_unused_bodies(gm)
        gm.recompile()
    return n


def _size_query(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    return (
        node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and (_size_query(node.args[0]))
    )


def drop_dead_size_queries(graph: fx.Graph) -> None:
    """Erase ``x.size()`` (and its items) that nothing reads.

    Dynamo leaves them in a region's body under dynamic shapes (``b, s, _ = x.shape``
    whose sizes come in as symbols), where they would read a sharded value for nothing.
    They are pure; a general dead-code sweep would also take in-place ops still to be
    functionalized.
    """
    for node in reversed(list(graph.nodes)):
        if not node.users and _size_query(node):
            graph.erase_node(node)


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its own graph (node meta copied shallowly, names kept) and its own copy
    of every body it holds, recursively: passes inline into bodies and delete submodules
    (``delete_all_unused_submodules`` reaches into a body), which must never reach the
    graph copied from. Other submodules, parameters and buffers are shared."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph, gm.__class__.__name__)
    for name, sub in list(copy.named_children()):
        if isinstance(sub, fx.GraphModule):
            setattr(copy, name, graph_copy(sub))
    return copy


def inlined_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every region call inlined (``gm`` and its bodies untouched)."""
    copy = graph_copy(gm)
    inline_all(copy)
    return copy


def drop_unused_bodies(gm: fx.GraphModule) -> None:
    """Erase the get_attr nodes nothing reads, and the bodies no node of ``gm`` names.

    Not ``delete_all_unused_submodules``: it counts only the names ``gm``'s own nodes use,
    so it deletes the bodies nested in a body a get_attr names (a checkpoint region's
    region calls), which that body's graph still reads (found by the fuzzer).
    """
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    used = {
        str(n.target).split(".", 1)[0]
        for n in gm.graph.nodes
        if n.op in ("get_attr", "call_module")
    }
    for name, sub in list(gm.named_children()):
        if isinstance(sub, fx.GraphModule) and name not in used:
            delattr(gm, name)


def free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def distinct_bodies(
    gm: fx.GraphModule, param_names: dict[str, str]
) -> list[tuple[fx.GraphModule, dict[str, str]]]:
    """Each body the graph's region calls run, once, with its placeholders' parameter names.

    A body placeholder is named after the parameter its first call passes (``param_names``
    maps the outer graph's placeholder names to parameter names).
    """
    found: dict[str, tuple[fx.GraphModule, dict[str, str]]] = {}
    for call in calls(gm.graph):
        target = call.args[0].target
        if target in found:
            continue
        body = body_of(call)
        holders = [n for n in body.graph.nodes if n.op == "placeholder"]
        names = {
            h.name: param_names[a.name]
            for h, a in zip(holders, operands(call), strict=True)
            if isinstance(a, fx.Node) and a.name in param_names
        }
        found[target] = (body, names)
    return list(found.values())
