"""Sharding rules of element-wise ops: arithmetic, activations, casts, comparisons, dropout.

Invariant: an element-wise op computes each output element from the aligned
elements of its (broadcast) inputs, so every rank computes its own shard of the
output from its shards of the inputs, and a replicated operand is sliced to
the same shard (no communication) unless it broadcasts along the shard dim.
Inputs sharded on different output dims cannot be combined locally: they fall
back. Dropout is the one op here whose values are random; it draws an
independent mask per shard. ``x.new_empty(sizes)`` and its kin read only ``x``'s
dtype and device: shaped like the shard, they are made locally, never gathered. A custom
``autograd.Function`` whose forward and backward are both element-wise (Bloom's GELU) is
one such op: its bodies run on the shard as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...ir.op_table import op_kind
from ...ir.ops import shape_of
from ...ir.subgraphs import body_nodes
from .. import sharded_ops as tp_ops
from ..placement import P, R, S
from ..strategy import Call, RuleContext, Strategy, fallback
from .core import aligned, tensor_inputs
from .registry import rule

ELEMENTWISE = (
    "add", "sub", "mul", "div", "neg", "pow", "square", "rsqrt", "exp",
    "sigmoid", "tanh", "relu", "silu", "gelu", "leaky_relu",
    "gt", "lt", "ge", "le", "eq", "ne", "where", "masked_fill",
    "clone", "detach", "contiguous", "cast", "type_as",
    "zeros_like", "ones_like", "full_like", "empty_like",
)  # fmt: skip


# always: with no input sharded a parameter operand stays undecided (peek), so a
# later shard can still decide it (a norm weight multiplied in after the norm).
# reads_blocks: every sharded operand in the same blocks (a fused q/k/v's frozen base plus its
# LoRA update, summed before the split) is read block by block, element by element.
@rule(*ELEMENTWISE, always=True, reads_blocks=True)
def elementwise(ctx: RuleContext, node: fx.Node) -> Strategy:
    out = shape_of(node)
    tensors = tensor_inputs(node)
    if any(ctx.peek(a) == P for a in tensors):
        return Strategy(out=R, whole=True)
    held = [pl for a in tensors if (pl := ctx.peek(a)) and pl.is_shard]
    dims = {aligned(ctx, a, out) for a in tensors if (pl := ctx.peek(a)) and pl.is_shard}
    if not dims:
        return Strategy(out=R, keep_open=True)
    # None: a sharded input of an op with no tensor output (``torch.where(mask)``'s
    # index tuple): gathered, never called replicated on a shard.
    if out is None or len(dims) > 1 or None in dims or len({pl.blocks for pl in held}) > 1:
        return fallback()
    [k], blk = dims, held[0].blocks
    nd = len(out)
    s = Strategy(out=S(k, blk))
    for a in tensors:
        sh = shape_of(a) or ()
        j = k - (nd - len(sh))  # the operand's dim aligned to output dim k
        if j < 0 or sh[j] == 1:
            continue  # broadcast along the sharded dim: read whole (an open one is fixed so)
        if ctx.is_open(a):
            s.fix[a] = S(j, blk)
        elif ctx.peek(a) == R:
            s.read(a, S(j, blk))
    return s


NEW_TENSORS = ("new_empty", "new_zeros", "new_ones", "new_full")


@rule(*NEW_TENSORS)
def new_tensor(ctx: RuleContext, node: fx.Node) -> Strategy:
    """``x.new_empty(sizes)`` of a shard: the shard's piece, made locally; else replicated.

    The values of ``x`` are never read, so nothing is gathered: a tensor with ``x``'s
    rank and ``x``'s global size on the shard dim is made at the local size there (a
    buffer the shard's values are written into, HF's MLA keys), anything else whole.
    """
    x, pl = node.args[0], ctx.placement(node.args[0])
    full = node.op == "call_method" and node.target == "new_full"
    sizes = node.args[1] if full or len(node.args) == 2 else node.args[1:]
    if isinstance(sizes, int):
        sizes = (sizes,)
    src, out = shape_of(x), shape_of(node)
    if (
        not pl.is_shard or pl.blocks or src is None or out is None or len(out) != len(src)
        or out[pl.dim] != src[pl.dim] or not isinstance(sizes, (tuple, list))
        or len(sizes) != len(out) or not isinstance(sizes[pl.dim], int)
    ):  # fmt: skip
        return Strategy(out=R)
    local = list(sizes)
    local[pl.dim] //= ctx.p
    rest = node.args[2:] if full else ()
    args = (x, tuple(local), *rest) if full or len(node.args) == 2 else (x, *local)
    # No input value is read: no copy_to_tp, nothing to sum back.
    return Strategy(out=pl, call=Call(node.target, args, dict(node.kwargs), node.op), copy_in=False)


@rule("dropout")
def dropout(ctx: RuleContext, node: fx.Node) -> Strategy:
    """Sharded input: :func:`tp_ops.sharded_dropout`, independent masks per shard.

    (A replicated input keeps plain dropout: synchronised RNG streams give
    every rank one mask.)
    """
    names = ("input", "p", "training", "inplace")
    bound = {"p": 0.5, "training": True, **dict(zip(names, node.args, strict=False))}
    bound.update(node.kwargs)
    x = bound["input"]
    pl = ctx.placement(x)
    args = (x, bound["p"], bound["training"], pl.dim, ctx.rank, ctx.p)
    return Strategy(out=pl, call=Call(tp_ops.sharded_dropout, args))


_SCALARS = (int, float, bool)


@rule("autograd_function_apply")
def autograd_function(ctx: RuleContext, node: fx.Node) -> Strategy:
    """``torch.autograd.Function.apply(x)`` of one plain shard, element-wise both ways.

    Dynamo traces the forward and the backward into two bodies; where each only combines
    its tensor inputs (``x``; the gradient and what was saved, all of ``x``'s shape) with
    Python scalars through element-wise ops, each rank's call computes its shard of the
    output and of the input gradient. Any other body (a reduction, a captured tensor, a
    non-tensor result) falls back.
    """
    tensors = tensor_inputs(node)
    pl = ctx.placement(tensors[0]) if len(tensors) == 1 else R
    bodies = body_nodes(node)
    if not pl.is_shard or pl.blocks or len(bodies) != 2 or not all(map(_elementwise, bodies)):
        return fallback()
    return Strategy(out=pl)


def _elementwise(body: list[fx.Node] | None) -> bool:
    """Every call in ``body`` is element-wise on body values and Python scalars."""
    if body is None:
        return False
    for n in body:
        if n.op in ("placeholder", "output"):
            continue
        if n.op != "call_function" and n.op != "call_method":
            return False
        if n.target is torch._C._set_grad_enabled:
            continue
        operands = [*n.args, *n.kwargs.values()]
        if (
            op_kind(n) not in ELEMENTWISE
            or op_kind(n) == "where"
            or not all(isinstance(a, (fx.Node, *_SCALARS)) for a in operands)
        ):
            return False
    return True
