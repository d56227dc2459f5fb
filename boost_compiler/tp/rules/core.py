"""Helpers the sharding-rule families share; no rule lives here.

A rule receives one dynamo-graph node whose inputs already have placements and
returns a :class:`~boost_compiler.tp.strategy.Strategy`: the node's placement from
the op's semantics and the fake-tensor shapes (never from module or parameter
names), the placements it reads its inputs as, and its call with global size
arguments made local. Invariant: a rule that cannot prove a sharded evaluation exact
returns :func:`~boost_compiler.tp.strategy.fallback`, which gathers the inputs
(exact, slower) and logs a warning naming the op; an op is never guessed at. The
helpers below are the pieces several families use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...ir.op_table import op_kind
from ...ir.ops import shape_of, value_of
from ..placement import P, Placement, R, S
from ..strategy import RuleContext, Strategy


def aligned(ctx: RuleContext, a: fx.Node, out: tuple[Any, ...] | None) -> int | None:
    """The output dim that ``a``'s shard dim broadcasts to; None without shapes."""
    pl, s = ctx.placement(a), shape_of(a)
    if out is None or s is None:
        return None
    return pl.dim + (len(out) - len(s))


def call_replicated(pl: Placement) -> Strategy:
    """Run the op on full values: its main input is ``pl``, replicated or partial."""
    return Strategy(out=R, whole=pl == P)


def shard_arg(ctx: RuleContext, s: Strategy, prm: Any) -> None:
    """A norm's weight or bias read as the hidden shard: fixed so if open, else sliced
    from the whole (no communication), or converted from another split."""
    if not isinstance(prm, fx.Node):
        return
    if ctx.is_open(prm):
        s.fix[prm] = S(0)
    elif ctx.placement(prm) != S(0):  # whole, or split otherwise (a forced plan's blocks)
        s.read(prm, S(0))


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]


def only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def is_cast(node: fx.Node) -> bool:
    """A dtype conversion of one tensor (same device), nothing else."""
    if op_kind(node) != "cast" or len(node.all_input_nodes) != 1:
        return False
    a, b = value_of(node.args[0]), value_of(node)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device


def requires_grad(node: fx.Node) -> bool:
    v = value_of(node)
    return isinstance(v, torch.Tensor) and v.requires_grad


def describe(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    where = next(reversed(stack.values()))[0] if stack else ""
    what = (
        node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
    )
    return f"op {what!r} (node {node.name}{', in ' + where if where else ''})"
