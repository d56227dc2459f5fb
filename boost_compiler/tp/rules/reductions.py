"""Sharding rules of reductions: sum/mean, softmax, RMS/layer norms (built in or written out).

Invariant: a reduction over dims other than the shard dim is local (each rank
reduces its own columns) and keeps the shard; one over exactly the shard dim
becomes a ``tp_ops`` kernel that reduces locally and all-reduces the result,
so its output is replicated. Norms over a hidden shard become ``tp_ops`` kernels
that all-reduce only their per-token statistics, in fp32. Softmax
is local along any dim but the shard dim. Anything else over the shard dim
(several dims at once, a blocked shard) falls back.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...ir.op_table import op_kind
from ...ir.ops import shape_of, value_of
from .. import plan_cost as cost
from .. import sharded_ops as tp_ops
from ..placement import R, S
from ..strategy import Call, Cost, Fuse, RuleContext, Strategy, fallback
from .core import is_cast, only_user, shard_arg
from .registry import rule


@rule("sum", "mean")
def reduction(ctx: RuleContext, node: fx.Node) -> Strategy:
    x = node.args[0]
    pl = ctx.placement(x)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    nd = len(shape_of(x))
    dims = (
        None
        if dim is None
        else {d % nd for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    )
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    if dims is not None and pl.dim not in dims and not pl.blocks:
        # Over other dims only (batch, sequence): each rank reduces its own columns.
        return Strategy(out=S(pl.dim - (0 if keepdim else sum(d < pl.dim for d in dims))))
    if dims != {pl.dim}:
        return fallback()
    if keepdim and pl.dim == nd - 1 and (norm := _written_rms_norm(ctx, node, x)) is not None:
        return norm
    full = shape_of(x)[pl.dim]
    fn = tp_ops.sharded_mean if op_kind(node) == "mean" else tp_ops.sharded_sum
    s = Strategy(out=R, call=Call(fn, (x, pl.dim, bool(keepdim), full, ctx.group)))
    s.cost = cost.all_reduces([cost.nbytes(value_of(node))], ctx.p)
    return s


@rule("softmax")
def softmax(ctx: RuleContext, node: fx.Node) -> Strategy:
    """Along a dim that is not the sharded one: every row a rank normalises is whole."""
    x = node.args[0]
    pl = ctx.placement(x)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if pl.blocks or dim is None or dim % len(shape_of(x)) == pl.dim:
        return fallback()
    return Strategy(out=pl)


@rule("rms_norm", "layer_norm")
def norm(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    """Over the hidden shard: a ``tp_ops`` norm that all-reduces its per-token statistics;
    or the input gathered and the norm computed whole, which the planner weighs where
    up factors read the normed value (they take it whole: a dense layer's input in a latent
    chain through the residual, as in a hybrid model's MLP)."""
    x = node.args[0]
    nd = len(shape_of(node))
    if ctx.peek(x) != S(nd - 1) or len(node.args[1]) != 1:
        return Strategy(out=R, whole=True)
    layer = op_kind(node) == "layer_norm"
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    if not layer:
        names = ("input", "normalized_shape", "weight", "eps")
    bound = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    weight, bias, eps = bound.get("weight"), bound.get("bias"), bound.get("eps")
    s = Strategy(out=S(nd - 1))
    shard_arg(ctx, s, weight)
    shard_arg(ctx, s, bias)
    d = node.args[1][0]
    if layer:
        s.call = Call(tp_ops.sharded_layer_norm, (x, weight, bias, eps, d, ctx.group))
    else:
        s.call = Call(tp_ops.sharded_rms_norm, (x, weight, eps, d, ctx.group))
    s.label, s.cost = "sharded", _statistics(ctx, node, 2 if layer else 1)
    if any(isinstance(a, fx.Node) and not ctx.is_open(a) and ctx.placement(a) != R
           for a in (weight, bias)):  # fmt: skip
        return s  # a forced split of its weight: kept sharded
    if not node.users or not all(ctx.role(u) == "up" for u in node.users):
        # Weighed only where up factors read it (they take it whole): the final norm before
        # a vocabulary-parallel head stays sharded, the plan costmodel.py's formulas describe.
        return s
    return [s, Strategy(out=R, whole=True, label="gathered, then whole")]


def _statistics(ctx: RuleContext, out: fx.Node, n: int) -> Cost:
    """A sharded norm's ``n`` fp32 statistics per token: each all-reduced forward, and
    again backward (f on the scale). Read only by down factors, they ride in those
    factors' own all-reduce instead (the default pass ``online_norm``): forward bytes,
    no collective of their own, nothing backward."""
    stats = cost.per_token(value_of(out), 1)
    if out.users and all(ctx.role(u) == "down" for u in out.users):
        return Cost(wire=n * cost.all_reduce(stats, ctx.p), logical=n * stats)
    return cost.all_reduces([stats] * (2 * n), ctx.p)


def _written_rms_norm(ctx: RuleContext, mean: fx.Node, sq: fx.Node) -> Strategy | None:
    """An RMSNorm written out (HF's ``LlamaRMSNorm``), made one sharded norm node.

    ``x * rsqrt(mean(x**2, -1, keepdim=True) + eps)``, optionally cast back to the
    dtype ``x`` had before an fp32 upcast and multiplied by a ``[d]`` weight, is
    ``torch.rms_norm`` computed in fp32: :func:`tp_ops.sharded_rms_norm` does the
    same arithmetic (fp32 statistics, cast, then the weight), so replacing the
    chain is exact. Why bother, when the generic rules already shard every op of
    it exactly: the generic path all-reduces the mean on its own, forward and
    (through ``f`` on the scale) backward, while one norm node is what the
    ``online_norm`` pass folds into the next down factors' all-reduce, so a
    written-out norm costs no collective, as BOOST's does. Matched on the
    dataflow only (every intermediate used once, eps a constant, ``x`` fp32);
    anything else keeps the generic rules.
    """
    found = _rms_chain(ctx, mean, sq)
    if found is None:
        return None
    x, xf, chain, eps = found
    end = chain[-1]
    d = shape_of(xf)[-1]
    weight = None
    wm = only_user(end)
    if wm is not None and op_kind(wm) == "mul" and end in wm.args and len(wm.args) == 2:
        w = wm.args[1] if wm.args[0] is end else wm.args[0]
        if isinstance(w, fx.Node) and shape_of(w) == (d,) and ctx.peek(w) in (None, R, S(0)):
            weight, end = w, wm
            chain.append(wm)
    s = Strategy(out=S(len(shape_of(x)) - 1))
    shard_arg(ctx, s, weight)
    s.call = Call(tp_ops.sharded_rms_norm, (x, weight, float(eps), d, ctx.group))
    s.fuse = Fuse(end, tuple(chain), (xf,) if x is not xf else ())
    s.cost = _statistics(ctx, end, 1)
    return s


def _rms_chain(
    ctx: RuleContext, mean: fx.Node, sq: fx.Node
) -> tuple[fx.Node, fx.Node, list[fx.Node], float] | None:
    """``(x, xf, chain, eps)`` of ``xf * rsqrt(mean(xf**2) + eps)`` [cast back to x's dtype].

    ``chain`` runs from the square to the last node the norm replaces (the
    scaled value, or its cast back); ``x`` is what the norm reads.
    """
    if op_kind(mean) != "mean" or len(sq.users) != 1:
        return None
    if len(mean.args) > 3 or not set(mean.kwargs) <= {"dim", "keepdim"}:
        return None  # e.g. mean(..., dtype=torch.float64): another arithmetic
    xf = _square_of(sq)
    value = value_of(xf)
    if xf is None or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    add = only_user(mean)
    eps = _added_constant(add, mean) if add is not None else None
    rs = only_user(add) if eps is not None else None
    if rs is None or op_kind(rs) != "rsqrt":
        return None
    scaled = only_user(rs)
    if scaled is None or op_kind(scaled) != "mul" or set(scaled.args) != {xf, rs}:
        return None
    chain = [sq, mean, add, rs, scaled]
    # The input the norm reads: x itself, or what x was cast from if the chain
    # casts back to that dtype (HF: .to(torch.float32) ... .to(input_dtype)).
    x = xf
    src = xf.args[0] if is_cast(xf) else None
    cast = only_user(scaled)
    if src is not None and cast is not None and is_cast(cast):
        if value_of(cast).dtype == value_of(src).dtype:
            x = src
            chain.append(cast)
    elif src is not None and value_of(src).dtype == torch.float32:
        x = src  # the upcast was a no-op
    if ctx.peek(x) != ctx.peek(xf):
        x = xf  # (a cast is element-wise: only a defensive check)
        chain = chain[:5]
    return x, xf, chain, eps


def _square_of(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` is ``x ** 2``, ``x.pow(2)``, ``x * x`` or ``x.square()``."""
    args, kind = node.args, op_kind(node)
    if kind == "pow" and len(args) == 2 and args[1] == 2:
        x = args[0]
    elif kind == "mul" and len(args) == 2 and args[0] is args[1]:
        x = args[0]
    elif kind == "square" and len(args) == 1:
        x = args[0]
    else:
        return None
    return x if isinstance(x, fx.Node) and not node.kwargs else None


def _added_constant(add: fx.Node, to: fx.Node) -> float | None:
    """``c`` when ``add`` is ``to + c`` with a Python number ``c`` (no alpha)."""
    if op_kind(add) != "add" or add.kwargs or len(add.args) != 2 or to not in add.args:
        return None
    c = add.args[1] if add.args[0] is to else add.args[0]
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None
