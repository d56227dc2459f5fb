"""Expert parallelism: a MoE block's routed experts placed whole on ranks, ``E/p`` each.

The stretch ``grouped_mm(x, w_up, offs) -> row-wise gate -> grouped_mm(h, w_down, offs)``
(``transformers``' experts) becomes one call, :func:`tp_ops.expert_parallel_ffn`, on the
rank's experts only: both weights split on ``E`` (``S(0)``), ``x`` read whole, the output
a partial sum (``P``). Invariant: exact. Inside a tensor-parallel group every rank holds the
same routed rows, sorted by expert, so rank ``i``'s experts own one contiguous row range;
the rank computes those rows as one device does and leaves zeros elsewhere, so summing over
the ranks gives every row once. No token moves: where torchtitan's expert parallelism
dispatches with ``all_to_all`` between ranks holding different tokens, these ranks hold the
same ones. The gate between the GEMMs must be row-wise (each output row reads only the same
row, constants otherwise) and read by nothing else: checked on the dataflow, anything else
keeps the split of ``experts.py``.

Why not always: the bytes are the intermediate split's (``x`` whole in, its gradient summed
by ``f``; a ``[S, H]`` partial out, the same pending sum), and that split gives every rank
the same work, where here a rank's work is the rows routed to its experts. So the split
is kept where it runs; this is taken where ``p`` does not divide the intermediate ``I`` (the
planner weighs it against running the experts whole: their weights held whole on every rank
price that out), where the split breaks ``torch._grouped_mm``'s alignment, or everywhere
under the ``btp`` pass's setting ``"expert_parallel"``.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch.fx as fx

from ...ir.op_table import op_kind
from ...ir.ops import is_elementwise_on_last_dim, shape_of
from .. import sharded_ops as tp_ops
from ..placement import P, R, S
from ..strategy import Call, Fuse, RuleContext, Strategy, replicated
from ..stretch import stretch_module
from .core import describe
from .registry import rule
from .slicing import split_sizes
from .views import swaps_matrices

_SPLITS = ("chunk", "split")


def ep_strategy(ctx: RuleContext, up: fx.Node, why: str) -> Strategy | None:
    """The expert-parallel strategy of the up GEMM ``up`` and the stretch it starts, or None
    where the stretch is not an up GEMM, a row-wise gate and a down GEMM on the same rows."""
    found = _stretch(ctx, up)
    if found is None:
        return None
    x, offs, (pu, su), (pd, sd), chain, down = found
    experts = shape_of(pu)[0]
    if not isinstance(experts, int) or experts % ctx.p or shape_of(pd)[0] != experts:
        return None
    for prm in (pu, pd):
        if not (ctx.is_open(prm) or ctx.placement(prm) == S(0)):
            return None
    local = experts // ctx.p
    views = tuple(operands(g)[1] if swapped else None for g, swapped in ((up, su), (down, sd)))  # type: ignore[index]
    ffn = stretch_module(x, ((pu, views[0]), (pd, views[1])), offs, [up, *chain, down])
    s = Strategy(out=P, label="expert parallel").read(x, R).read(offs, R)
    for prm in (pu, pd):
        s.read(prm, S(0))
        if ctx.is_open(prm):
            s.fix[prm] = S(0)
    s.call = Call(tp_ops.expert_parallel_ffn, (x, pu, pd, offs, ffn, ctx.rank * local))
    dead = tuple(v for v in views if v is not None)
    s.fuse = Fuse(down, (up, *chain, down), dead)
    s.note = (
        f"{describe(up)}: experts {ctx.param_name(pu)!r} and {ctx.param_name(pd)!r} "
        f"expert-parallel, {local} of {experts} per rank ({why})"
    )
    return s


def _stacked_experts(ctx: RuleContext, node: fx.Node) -> bool:
    """``bmm(x, w)``: a whole ``x`` [E, n, k] times an open stack of expert weights ``w``
    [E, k, m] that ``p`` divides (dense experts: every token through every expert)."""
    x, w = (node.args + (None, None))[:2]
    shape = shape_of(w) if isinstance(w, fx.Node) else None
    return (
        ctx.is_open(w) and ctx.peek(x) == R and shape is not None and len(shape) == 3
        and isinstance(shape[0], int) and shape[0] % ctx.p == 0
    )  # fmt: skip


@rule("bmm", guard=_stacked_experts, always=True)
def stacked_experts(ctx: RuleContext, node: fx.Node) -> list[Strategy]:
    """Dense experts: each rank its ``E/p`` experts on every token (``x`` and ``w`` on their
    batch dim), or all of them whole, as the planner weighs (the weights held whole on every
    rank against ``f`` on ``x``). Exact: the experts are independent along the batch dim;
    the next ``bmm`` takes its stack on the same dim (``matrix.same_shard``), and their
    combine over the experts is a sum over the split dim."""
    x, w = node.args[:2]
    split = Strategy(out=S(0), label="experts on ranks").read(x, S(0)).read(w, S(0))
    split.fix[w] = S(0)
    return [replace(replicated(), label="experts whole"), split]


def down_gemm(ctx: RuleContext, up: fx.Node) -> fx.Node | None:
    """The down GEMM of the stretch the up GEMM ``up`` starts, or None."""
    found = _stretch(ctx, up)
    return None if found is None else found[-1]


def operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(x, w, offs)`` of a 2-D by 3-D grouped GEMM without bias; None for any other form."""
    args, kw = node.args, node.kwargs
    x = args[0] if args else kw.get("input", kw.get("mat_a"))
    w = args[1] if len(args) > 1 else kw.get("weight", kw.get("mat_b"))
    offs = args[2] if len(args) > 2 else kw.get("offs")
    bias = args[3] if len(args) > 3 else kw.get("bias")
    if not all(isinstance(a, fx.Node) for a in (x, w, offs)) or bias is not None:
        return None
    xs, ws = shape_of(x), shape_of(w)
    if xs is None or ws is None or len(xs) != 2 or len(ws) != 3:
        return None
    return x, w, offs


def expert_weight(ctx: RuleContext, w: fx.Node) -> tuple[fx.Node, bool] | None:
    """The parameter ``w`` reads, and whether through ``transpose(-2, -1)``; None otherwise."""
    if ctx.is_param(w):
        return w, False
    if swaps_matrices(w) and ctx.is_param(w.args[0]):
        return w.args[0], True
    return None


def _stretch(ctx: RuleContext, up: fx.Node) -> tuple | None:
    """``(x, offs, (w_up, swapped), (w_down, swapped), gate chain, down)`` or None."""
    ops = operands(up)
    if ops is None:
        return None
    x, w, offs = ops
    wu = expert_weight(ctx, w)
    chain: list[fx.Node] = []  # every node the up GEMM's value reaches before the down
    downs, frontier = set(), [up]
    while frontier:
        for user in frontier.pop().users:
            if op_kind(user) == op_kind(up):
                downs.add(user)
            elif not _row_wise(user):
                return None  # the up GEMM's value reaches something other than a gate
            elif user not in chain:
                chain.append(user)
                frontier.append(user)
    inside = {up, *chain}
    if len(downs) != 1 or wu is None:
        return None
    down = downs.pop()
    read = operands(down)
    if read is None or read[0] not in inside or read[2] is not offs:
        return None
    for node in chain:
        if not set(node.all_input_nodes) <= inside:
            return None
        if any(u not in inside and u is not down for u in node.users):
            return None
    wd = expert_weight(ctx, read[1])
    if wd is None or wd[0] is wu[0]:
        return None
    return x, offs, wu, wd, _in_order(chain, up), down


def _in_order(chain: list[fx.Node], up: fx.Node) -> list[fx.Node]:
    """``chain`` in an order that computes each node after its inputs (read off the
    dataflow: a rule does not walk the graph)."""
    done, out, todo = {up}, [], list(chain)
    while todo:
        ready = [n for n in todo if set(n.all_input_nodes) <= done]
        out += ready
        done.update(ready)
        todo = [n for n in todo if n not in done]
    return out


def _row_wise(node: fx.Node) -> bool:
    """Each output row of ``node`` reads only the same row of its inputs (2-D rows)."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        return op_kind(src) in _SPLITS and isinstance(node.args[1], int)
    if op_kind(node) in _SPLITS:
        return split_sizes(node, -1) is not None
    # not dropout: every rank would draw the same mask over its rolled rows
    return (
        is_elementwise_on_last_dim(node) and len(shape_of(node) or ()) == 2
        and op_kind(node) != "dropout"
    )  # fmt: skip
