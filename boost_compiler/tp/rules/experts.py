"""Sharding rules of grouped GEMMs: a MoE block's routed experts split over the group.

``grouped_mm(x [S, K], w [E, K, N], offs [E])`` multiplies the rows of ``x`` that
``offs`` assigns to expert ``e`` by ``w[e]`` (``transformers``' ``grouped_mm_fallback``,
``torch._grouped_mm``). Invariant: the experts are split on their own ``K`` or ``N``,
never on ``E``, so every rank runs every expert on the same rows and no token moves
between ranks: a replicated ``x`` makes the GEMM column-parallel (``w`` split on ``N``,
per block where the output is chunked into gate and up, the output split on ``N``); an
``x`` split on ``K`` makes it row-parallel (``w`` split on ``K``, the partial product
converted at once or, through the ops linear in it, where the experts' outputs are
combined per token: the planner weighs them). Both are exact: each
output column, or the sum over ``K``, is what one device computes. An up GEMM reading
the router's gathered hidden is therefore column-parallel, its activation local, and the
down GEMM row-parallel (Megatron inside each expert); one reading a hidden shard is
row-parallel and its down GEMM column-parallel (the fine-grained expert as a bottleneck,
``docs/moe.md``). The expert weights are usually read through
``w.transpose(-2, -1)``, which leaves them open (``views.open_weight_transpose``) so
that this rule places them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...errors import ExpertAlignmentError
from ...ir.op_table import add_library_op, add_spelling, op_kind
from ...ir.ops import is_elementwise_on_last_dim, shape_of, value_of
from .. import plan_cost as cost
from ..placement import P, Placement, R, S
from ..strategy import RuleContext, Strategy, Then, fallback, replicated
from .expert_parallel import down_gemm, ep_strategy, expert_weight, operands
from .matrix import fused_blocks
from .registry import rule

KIND = "grouped_mm"
add_spelling(KIND, *(f for f in (getattr(torch, "_grouped_mm", None),
                                 getattr(F, "grouped_mm", None)) if f is not None))  # fmt: skip
# transformers' float32 / CPU kernel, registered when its MoE integration is imported.
add_library_op(KIND, "transformers::grouped_mm_fallback")

_ROW, _COL = S(1), 2  # x's contracted dim; the weight's output dim (of [E, K, N])
# torch's own kernel: on CUDA its operands' strides must be 16-byte aligned (transformers'
# fallback op, a loop of mm, has no such need)
_TORCH_KERNELS = tuple(f for f in (getattr(torch, "_grouped_mm", None),
                                   getattr(F, "grouped_mm", None),
                                   getattr(torch.ops.aten, "_grouped_mm", None)) if f is not None)  # fmt: skip
_ALIGN_BYTES = 16


# always: the GEMM places its expert weights, whose inputs are replicated at first.
@rule(KIND, always=True, reads_blocks=True)
def grouped_mm(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    ops = operands(node)
    if ops is None:
        return _whole(ctx, node)
    x, w, offs = ops
    if P in (ctx.peek(x), ctx.peek(w)):
        return Strategy(out=R, whole=True)  # a pending sum, summed first
    if ctx.placement(offs) != R or ctx.placement(x).blocks:
        return fallback()
    found = expert_weight(ctx, w)
    x_pl = ctx.placement(x)
    if found is not None and ctx.is_open(found[0]):
        if x_pl in (R, _ROW) and _down_factor(node):  # BTP: the rank carries the sum
            return _narrow_row_parallel(ctx, node, x, found)
        if x_pl == _ROW:  # a hidden shard dispatched: the expert is a bottleneck
            return _row_parallel(ctx, node, x, w, found)
        return _split_or_experts(ctx, node, x, w, found) if x_pl == R else fallback()
    w_pl = ctx.placement(w)
    if w_pl == S(0) and x_pl == R:  # planned expert-parallel (a second walk, a forced plan)
        ep = ep_strategy(ctx, node, "as planned")
        if ep is not None:
            return ep
    if w_pl == S(1) or (w_pl == R and x_pl == _ROW):  # a whole weight: this rank's K rows
        return _row_parallel(ctx, node, x, w, found)
    if w_pl.is_shard and w_pl.dim == _COL:
        return _column_parallel(ctx, node, x, w, found)
    return replicated() if (w_pl, x_pl) == (R, R) else fallback()


def _whole(ctx: RuleContext, node: fx.Node) -> Strategy:
    """A form this rule does not split (a bias, other than 2-D by 3-D): on full values."""
    sharded = any((pl := ctx.peek(a)) is not None and pl != R for a in node.all_input_nodes)
    return fallback() if sharded else replicated()


def _row_parallel(
    ctx: RuleContext, node: fx.Node, x: fx.Node, w: fx.Node, found: tuple[fx.Node, bool] | None
) -> Strategy | list[Strategy]:
    """``x`` and ``w`` split on ``K``: a partial ``[S, N]``, converted at once (all-reduced or
    reduce-scattered) or left pending through the ops linear in it (``partial.py``: the
    routing weights, the token order, the sum over the top-k), for the planner to weigh."""
    s = Strategy(out=P).read(x, _ROW)
    if not _take(ctx, s, node, found, S(1)):
        return fallback()
    pending = replace(s, label="pending")
    reduced = replace(s, then=Then(R, "experts row-parallel"), label="all-reduce")
    n = shape_of(node)[1]
    if not isinstance(n, int) or n % ctx.p:
        return [reduced, pending]
    scattered = replace(s, then=Then(S(1), "experts row-parallel"), label="reduce-scatter")
    return [reduced, scattered, pending]


def _split_or_experts(
    ctx: RuleContext, node: fx.Node, x: fx.Node, w: fx.Node, found: tuple[fx.Node, bool]
) -> Strategy | list[Strategy]:
    """An up GEMM on the gathered rows: its column-parallel split (the intermediate split of
    both GEMMs), or the experts on ranks (``expert_parallel.py``) where that split cannot
    run split or is asked not to. Not weighed where it can: the bytes are equal."""
    if ctx.expert_parallel and (ep := ep_strategy(ctx, node, "the btp setting")):
        return ep
    down = down_gemm(ctx, node)
    inner = shape_of(operands(down)[0])[1] if down is not None else None  # type: ignore[index]
    if isinstance(inner, int) and inner % ctx.p:
        why = f"tp={ctx.p} does not divide their intermediate {inner}; weighed against whole"
        if (ep := ep_strategy(ctx, node, why)) is not None:
            # whole: the weight sits behind its transpose, where the planner's price of a
            # weight held whole does not see it
            whole = Strategy(out=R, whole=True, cost=cost.held(value_of(found[0]), ctx.p))
            return [whole, ep]
    try:
        split = _column_parallel(ctx, node, x, w, found)
        if down is not None:  # the down GEMM's half of the split, checked now
            _check_aligned(ctx, down, operands(down)[1], 1)  # type: ignore[index]
        return split
    except ExpertAlignmentError:
        ep = ep_strategy(ctx, node, "their intermediate split breaks the kernel's alignment")
        if ep is None:
            raise
        return ep


def _column_parallel(
    ctx: RuleContext, node: fx.Node, x: fx.Node, w: fx.Node, found: tuple[fx.Node, bool] | None
) -> Strategy:
    """``x`` whole and ``w`` split on ``N`` (per gate/up block): the output split on ``N``.

    Where ``N`` does not divide, the experts run whole (exact, as before the split).
    """
    blocks = fused_blocks(ctx, node)
    n = shape_of(w)[_COL]
    if not blocks and (not isinstance(n, int) or n % ctx.p):
        return replicated() if ctx.placement(x) == R else fallback()
    s = Strategy(out=S(1, blocks)).read(x, R)
    return s if _take(ctx, s, node, found, S(_COL, blocks)) else fallback()


def _take(
    ctx: RuleContext,
    s: Strategy,
    node: fx.Node,
    found: tuple[fx.Node, bool] | None,
    want: Placement,
) -> bool:
    """Read the GEMM ``node``'s weight operand as ``want``; fix its open parameter so
    (through the transpose: ``K``/``N`` swap). A whole weight is sliced on a plain split
    (exact, its gradient gathered back); False for anything else."""
    w = operands(node)[1]  # type: ignore[index]
    if want.dim is not None and want.dim > 0:
        _check_aligned(ctx, node, w, want.dim)
    if found is not None and ctx.is_open(found[0]):
        param, swapped = found
        dim = {1: 2, 2: 1}[want.dim] if swapped else want.dim
        size = shape_of(param)[dim]
        if not isinstance(size, int) or size % ctx.p:
            return False
        s.fix[param] = S(dim, want.blocks)
        # The transpose was planned whole while its parameter was open: reading it as
        # ``want`` here is a slice; the second walk plans the transpose of the shard.
        s.read(w, want)
        return True
    got = ctx.placement(w)
    if got == want:
        return True
    if got != R or want.blocks:
        return False
    s.read(w, want)
    return True


def _down_factor(node: fx.Node) -> bool:
    """A per-expert factor pair's down factor: its output, narrower than its input, is read
    (through ops element-wise on the last dim) as the input of a grouped GEMM that widens
    it again. ``to_low_rank(experts=True)``'s experts; dense experts never qualify (their
    gate/up output is chunked before the down GEMM reads it)."""
    ops = operands(node)
    assert ops is not None
    k, n = shape_of(ops[0])[1], shape_of(node)[1]
    if not (isinstance(k, int) and isinstance(n, int)) or n >= k:
        return False
    frontier, seen = [node], set()
    while frontier:
        cur = frontier.pop()
        for user in cur.users:
            if user in seen:
                continue
            seen.add(user)
            up = operands(user) if op_kind(user) == KIND else None
            if up is not None and up[0] is cur:
                return shape_of(user)[1] > n
            if is_elementwise_on_last_dim(user):
                frontier.append(user)
    return False


def _narrow_row_parallel(
    ctx: RuleContext, node: fx.Node, x: fx.Node, found: tuple[fx.Node, bool]
) -> Strategy:
    """A down factor row-parallel (a replicated input sliced on ``K``), its narrow partial
    all-reduced at once: the next (up) factor reads it whole and runs column-parallel."""
    s = Strategy(out=P).read(x, _ROW)
    if not _take(ctx, s, node, found, S(1)):
        return fallback()
    return replace(s, then=Then(R, "experts bottleneck"), label="all-reduce")


def _check_aligned(ctx: RuleContext, node: fx.Node, w: fx.Node, dim: int) -> None:
    """Refuse, at plan time, a split of ``w`` (as the GEMM reads it, ``[E, K, N]``) on
    ``dim`` whose per-rank width breaks ``torch._grouped_mm``'s 16-byte stride alignment:
    the rank's ``[S, K/p]`` input or ``[E, K, N/p]`` weight would have a misaligned row
    stride, which the CUDA kernel rejects only when the step runs. Checked on every
    device: a plan is the same wherever it was made."""
    if node.target not in _TORCH_KERNELS:
        return
    val, size = value_of(w), (shape_of(w) or ())[dim : dim + 1]
    if not size or not isinstance(size[0], int) or size[0] % ctx.p or val is None:
        return  # not split evenly: the rule runs these experts whole
    per_rank, itemsize = size[0] // ctx.p, val.dtype.itemsize
    if per_rank * itemsize % _ALIGN_BYTES == 0:
        return
    step = _ALIGN_BYTES // itemsize
    good = [p for p in range(2, 65) if size[0] % (p * step) == 0][:4]
    raise ExpertAlignmentError(
        f"{node.name}: torch._grouped_mm's expert weight [E, K, N] = {list(shape_of(w))} "
        f"split on {'KN'[dim - 1]} over tp={ctx.p} gives each rank {per_rank} "
        f"{val.dtype} elements, and on CUDA the kernel needs a multiple of {step} "
        f"({_ALIGN_BYTES} bytes). Use a tensor-parallel size that keeps it aligned "
        f"({', '.join(map(str, good)) or 'none up to 64'}), or pad that width ({size[0]}) "
        f"to a multiple of {step * ctx.p}"
    )
