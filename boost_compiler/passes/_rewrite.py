"""Graph helpers shared by the passes that run after ``btp``.

After ``btp`` a row-parallel contraction is a ``F.linear``/``matmul`` node whose
only user is a ``reduce_from_tp`` node (Megatron's g), and a column-parallel
one reads its replicated input through a ``copy_to_tp`` node (f). The passes
that merge collectives find those shapes structurally and rewrite them; the
plan reads the merged collectives off the rewritten graph.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import Any

import torch
import torch.fx as fx

from ..ir.op_table import function_spellings, op_kind
from ..ir.ops import value_of
from ..tp import collectives as C

# The targets a rewritten contraction has (group_linears matches on them).
LINEAR = function_spellings("linear")
MATMUL = function_spellings("matmul")


def is_reduce(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is C.reduce_from_tp


def is_copy(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is C.copy_to_tp


def reduce_of(node: fx.Node) -> fx.Node | None:
    """The g node when ``node`` is a row-parallel partial (its only user), else None."""
    users = list(node.users)
    return users[0] if len(users) == 1 and is_reduce(users[0]) else None


def weight_arg(node: fx.Node) -> Any:
    """The weight expression of a plain ``F.linear(x, w[, b])`` or ``x @ w`` node."""
    if node.op != "call_function":
        return None
    kind = op_kind(node)
    if kind == "linear":
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if kind == "matmul":
        return node.args[1]
    return None


def bias_arg(node: fx.Node) -> Any:
    if op_kind(node) == "linear":
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return None


def last_size(node: Any) -> int | None:
    v = value_of(node)
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return None
    size = v.shape[-1]
    return size if isinstance(size, int) else None


def split_uses(graph: fx.Graph, whole: fx.Node, sizes: list[int], olds: list[fx.Node]) -> None:
    """``whole.split(sizes, -1)``; piece i takes over every use of ``olds[i]``."""
    with graph.inserting_after(whole):
        parts = graph.call_function(torch.split, (whole, sizes, -1))
    anchor = parts
    for i, old in enumerate(olds):
        with graph.inserting_after(anchor):
            piece = graph.call_function(operator.getitem, (parts, i))
        old.replace_all_uses_with(piece)
        anchor = piece


def finish(gm: fx.GraphModule) -> None:
    """Restore a topological order, in place (new nodes sit next to one of their uses).

    Not ``torch.fx.passes.tools_common.stable_topological_sort``: it swaps in a
    new ``fx.Graph``, and a ``CustomGraphPass`` must rewrite the graph it is given.
    Same algorithm (Kahn's, ties broken by the current position), applied by
    moving nodes.
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    missing = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(position[n], n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            missing[user] -= 1
            if missing[user] == 0:
                heapq.heappush(ready, (position[user], user))
    if len(order) != len(nodes):
        raise AssertionError("boost: a rewrite created a cycle in the graph")
    for prev, node in itertools.pairwise(order):
        prev.append(node)
    gm.recompile()
