"""Sharding rules of ops that read a partial sum: keep it pending where the op is linear in it.

A partial value (``P``: each rank holds a term, the value is their sum) comes from a
row-parallel GEMM whose conversion the planner deferred: the experts' down GEMM, whose
``[N k, H]`` rows are weighted by the router, put back in token order and summed over
the top-k before the residual add, so the sum converted there is ``k`` times smaller.
Invariant: an op keeps ``P`` only where it is linear in its partial input and every
other input is the same on every rank (``f(sum_i a_i, b) = sum_i f(a_i, b)``): views,
casts between float dtypes, index selections by replicated indices, sums and means, a
product with (or quotient by) a replicated value, a sum or difference of partials. It
never makes the pending value larger (converting a broadcast later would cost more),
and its call is the single-device one (a partial holds the global shape). Anything else
converts its partial inputs first: reduce-scattered onto the shard another input holds
(a residual add), or all-reduced. Each rank's gradient of a pending value is the whole
gradient, which every linear op's backward maps to the gradient of its own term; the
applier's ``f`` on a replicated operand (the router weights) sums its per-rank parts.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ...ir.op_table import op_kind
from ...ir.ops import shape_of, value_of
from ..placement import P, R, S
from ..strategy import RuleContext, Strategy
from .core import aligned, is_cast, tensor_inputs
from .registry import partial_rule

_VIEWS = ("view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute", "t")
_LINEAR = (*_VIEWS, "clone", "contiguous", "neg", "sum", "mean", "getitem", "cast")


def _summed() -> Strategy:
    """The partial inputs all-reduced first, the op on full values."""
    return Strategy(out=R, whole=True)


def _no_larger(node: fx.Node, partials: list[fx.Node]) -> bool:
    """Whether the output has no more elements than each partial input (symbolic sizes at
    their hints: a cost question, the values are exact either way)."""
    out = value_of(node)
    if not isinstance(out, torch.Tensor):
        return False
    return all(_numel(out) <= _numel(value_of(a)) for a in partials)


def _numel(t: torch.Tensor) -> int:
    return int(optimization_hint(t.numel()))


@partial_rule(*_LINEAR)
def linear(ctx: RuleContext, node: fx.Node) -> Strategy:
    """One partial input, read as is; the others (an index) replicated."""
    tensors = tensor_inputs(node)
    partials = [a for a in tensors if ctx.peek(a) == P]
    others_whole = all(ctx.peek(a) == R for a in tensors if a not in partials)
    if len(partials) != 1 or partials[0] is not node.args[0] or not others_whole:
        return _summed()
    if op_kind(node) == "cast" and not _float_cast(node):
        return _summed()
    return Strategy(out=P) if _no_larger(node, partials) else _summed()


def _float_cast(node: fx.Node) -> bool:
    a, b = value_of(node.args[0]), value_of(node)
    return is_cast(node) and a.is_floating_point() and b.is_floating_point()


@partial_rule("mul", "div")
def scaled(ctx: RuleContext, node: fx.Node) -> Strategy:
    """A partial times a replicated value (or a number), or divided by one."""
    tensors = tensor_inputs(node)
    partials = [a for a in tensors if ctx.peek(a) == P]
    if len(partials) != 1 or (op_kind(node) == "div" and node.args[0] is not partials[0]):
        return _onto_shard(ctx, node, tensors)
    if any(ctx.peek(a) != R for a in tensors if a is not partials[0]):
        return _onto_shard(ctx, node, tensors)
    return Strategy(out=P) if _no_larger(node, partials) else _summed()


@partial_rule("add", "sub")
def summed(ctx: RuleContext, node: fx.Node) -> Strategy:
    """Partials added: still partial (``alpha`` scales one, still linear; a number added is
    not). A partial added to a shard (the residual stream): reduce-scattered onto that
    shard; to anything else: all-reduced."""
    tensors = tensor_inputs(node)
    if (
        all(isinstance(a, fx.Node) and ctx.peek(a) == P for a in node.args)
        and set(node.kwargs) <= {"alpha"}
        and _no_larger(node, tensors)
    ):
        return Strategy(out=P)
    return _onto_shard(ctx, node, tensors)


def _onto_shard(ctx: RuleContext, node: fx.Node, tensors: list[fx.Node]) -> Strategy:
    """The partials reduce-scattered onto the one plain shard the other inputs hold (the
    element-wise op then local, a replicated operand sliced); without one, all-reduced."""
    out = shape_of(node)
    shards = {ctx.peek(a) for a in tensors} - {P, R, None}
    dims = {aligned(ctx, a, out) for a in tensors if ctx.peek(a) in shards}
    if out is None or len(dims) != 1 or None in dims or any(pl.blocks for pl in shards):
        return _summed()
    [k] = dims
    s = Strategy(out=S(k))
    for a in tensors:
        sh = shape_of(a) or ()
        j = k - (len(out) - len(sh))
        if ctx.peek(a) == P:
            if j < 0 or sh[j] == 1:
                return _summed()  # a broadcast partial: no shard of it to scatter onto
            s.read(a, S(j), "partial onto the shard")
        elif ctx.peek(a) == R and j >= 0 and sh[j] != 1:
            s.read(a, S(j))
        elif ctx.peek(a) is None:
            return _summed()
    return s
