"""Sharding rules of views and layout ops: view/reshape/flatten/view_as, transpose/permute, expand,
repeat.

Invariant: a view moves no values between ranks, so a shard stays a shard,
on the dim the view maps it to (:func:`~boost_compiler.tp.placement.shard_through_view`),
and the call is rewritten to the local shape: a size argument on the shard dim
is divided by ``p`` (or becomes ``-1``, "keep"). A shard merged behind a leading dim
(Bloom's ``[b, H, s, hd] -> [b*H, s, hd]``) becomes equal blocks of the merged dim, and
their split back a plain shard (:func:`~boost_compiler.tp.placement.blocks_through_view`);
a view that would split a rank's block across output dims is not local: it falls back.
Every rule here reads one tensor (``view_as`` reads only the other's shape), so it only
runs on a shard. The exceptions to "no values move": a key/value head split on its head
dim and repeated to every query head may be gathered before the repetition instead, where
the planner finds that cheaper than its attention gathering the copies, and a single
key/value head viewed out of a feature shard is gathered at that view.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ...errors import ShardingError
from ...ir.op_table import op_kind
from ...ir.ops import shape_of, value_of, weight_step
from .. import plan_cost as cost
from ..placement import Placement, R, S, blocks_through_view, shard_through_view
from ..strategy import Call, RuleContext, Strategy, fallback
from .core import describe
from .registry import rule


def _sizes(node: fx.Node) -> tuple:
    """The target sizes of ``x.view(*sizes)`` / ``x.view(sizes)`` (and expand, reshape)."""
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    return tuple(sizes)


@rule("view", "reshape", "flatten", "unflatten", reads_blocks=True)
def view(ctx: RuleContext, node: fx.Node) -> Strategy:
    x = node.args[0]
    pl = ctx.placement(x)
    src, dst = shape_of(x), shape_of(node)
    moved = None if pl.blocks else shard_through_view(src, dst, pl.dim, ctx.p)
    # Not contiguous after the view, yet local: a merge behind another dim (Bloom's
    # ``reshape(batch * heads, ...)``) as equal blocks, and their split back.
    out = blocks_through_view(src, dst, pl, ctx.p) if moved is None else None
    if moved is None and out is None:
        return fallback()
    if op_kind(node) == "flatten":
        # Its arguments are dims, not sizes: the same call flattens the local
        # shard. Exact when the shard dim leads its merged group (or is outside
        # it), which shard_through_view checks: each rank's block stays whole.
        if out is not None:
            return Strategy(out=out)
        if moved[1] % ctx.p:
            return fallback()
        return Strategy(out=S(moved[0]))
    unflatten = op_kind(node) == "unflatten"  # Falcon's heads on transformers 5.25
    sizes = _unflatten_args(node)[1] if unflatten else _sizes(node)
    if sizes is None or (not unflatten and len(sizes) != len(dst)):
        return fallback()
    if out is None:
        k, divisor = moved
        if _few_heads(src, dst, pl.dim, k, ctx.p) and _keys_or_values(node):
            return Strategy(
                out=R, whole=True,
                label=f"{divisor} key/value heads, fewer than the ranks: whole on every rank",
            )  # fmt: skip
        if divisor % ctx.p:
            raise ShardingError(
                f"{describe(node)}: dimension {k} of size {divisor} (heads or hidden) is not "
                f"divisible by the tensor-parallel degree p={ctx.p}"
            )
        if _single_head(src, dst, pl.dim, k):
            return Strategy(out=R, whole=True, label="one key/value head, whole on every rank")
        out = S(k)
    if unflatten:
        return _unflatten(ctx, node, out)
    k = out.dim
    new_sizes = list(sizes)
    if isinstance(new_sizes[k], int) and new_sizes[k] != -1:
        new_sizes[k] //= ctx.p
    elif not (isinstance(new_sizes[k], int) and new_sizes[k] == -1):
        return fallback()
    return Strategy(out=out, call=_with_args(node, (x, *new_sizes)))


def _unflatten(ctx: RuleContext, node: fx.Node, out: Placement) -> Strategy:
    """``x.unflatten(dim, sizes)`` on the shard: the size the shard lands on is divided by
    p (a ``-1`` infers it); a shard outside the split dim keeps ``sizes`` as they are."""
    x = node.args[0]
    dim, sizes = _unflatten_args(node)
    dim %= len(shape_of(x))
    sizes, k = list(sizes), out.dim
    if dim <= k < dim + len(sizes) and sizes[k - dim] != -1:
        sizes[k - dim] //= ctx.p
    return Strategy(out=out, call=Call(node.target, (x, dim, tuple(sizes)), {}, node.op))


def _unflatten_args(node: fx.Node) -> tuple[int, tuple | None]:
    """``(dim, sizes)`` of an unflatten, positional or keyword; sizes None if symbolic."""
    args = (*node.args[1:], *(node.kwargs[k] for k in ("dim", "sizes") if k in node.kwargs))
    sizes = tuple(args[1]) if len(args) == 2 else None
    if sizes is None or not all(isinstance(n, int) for n in sizes):
        return 0, None
    return int(args[0]), sizes


def _single_head(src: tuple, dst: tuple, dim: int, k: int) -> bool:
    """A feature shard viewed as one head, ``[b, s, hd] -> [b, s, 1, hd]`` (multi-query
    attention's key or value): gathered here, at its smallest, once.

    One head cannot split on the heads, and every head-wise op of it reads all its
    features (rotary's halves, ``k[..., :hd // 2]``, then the attention of every query
    head): kept on its features it is gathered later anyway, after rotary's slices fell
    back, or after the expansion to the query heads at ``n_head`` times the bytes.
    """
    return (
        len(dst) >= 2 and dim == len(src) - 1 and k == len(dst) - 1
        and dst[-2] == 1 and src[-1] == dst[-1]
    )  # fmt: skip


def _few_heads(src: tuple, dst: tuple, dim: int, k: int, p: int) -> bool:
    """A feature shard viewed as fewer heads than ranks, ``[b, s, n hd] -> [b, s, n, hd]``
    with ``1 < n < p`` dividing ``p`` (grouped-query attention's keys or values at a larger
    tensor-parallel degree; other counts, and query heads, are refused by name, as before): no rank can hold a whole head, so they are gathered here, unexpanded, as
    Megatron replicates such key/value heads; the query heads stay split and each rank reads
    the key/value heads its own query heads use."""
    return (
        dim == len(src) - 1 and k == len(dst) - 2 and len(dst) >= 2
        and isinstance(dst[-2], int) and 1 < dst[-2] < p and p % dst[-2] == 0
        and dst[-2] * dst[-1] == src[-1]
    )  # fmt: skip


@rule("view_as")
def view_as(ctx: RuleContext, node: fx.Node) -> Strategy:
    """``x.view_as(other)``: a view to ``other``'s shape, the shard moved as by ``view``.

    ``other`` sharded the same way already has the local shape (the call stays); a
    replicated ``other`` (``y.view_as(x)`` merging heads back into the hidden of the
    residual stream) gives the local shape with the shard dim kept (:func:`view_as_shard`).
    A replicated ``x`` viewed as a shard's shape stays whole: the shard's global shape
    (:func:`view_as_whole`, a MoE's combined experts back to the residual's shape).
    """
    x, other = node.args[0], node.args[1]
    pl, held = ctx.placement(x), ctx.placement(other)
    if pl == R and held.is_shard and not held.blocks:
        return Strategy(out=R, call=Call(view_as_whole, (x, other, held.dim, ctx.p)))
    src, dst = shape_of(x), shape_of(node)
    moved = shard_through_view(src, dst, pl.dim, ctx.p) if not pl.blocks else None
    if moved is None or moved[1] % ctx.p:
        return fallback()
    k = moved[0]
    if held == S(k):
        return Strategy(out=S(k))
    if held != R:
        return fallback()
    # ``other``'s values are never read: nothing to gather or differentiate through.
    return Strategy(out=S(k), call=Call(view_as_shard, (x, other, k)), copy_in=False)


def view_as_shard(x: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` (a shard) viewed as ``like``'s shape with dim ``dim`` left to ``x``'s size."""
    sizes = list(like.shape)
    sizes[dim] = -1
    return x.view(sizes)


def view_as_whole(x: torch.Tensor, like: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """``x`` (whole) viewed as the global shape of ``like``, a shard of ``p`` on ``dim``."""
    sizes = list(like.shape)
    sizes[dim] *= p
    return x.view(sizes)


def _with_args(node: fx.Node, args: tuple) -> Call:
    return Call(node.target, args, dict(node.kwargs), node.op)


# reads_blocks: a blocked dim moves with its blocks (Bloom's keys transposed while their
# batch and heads are merged; GPT-BigCode's fused output unsqueezed before its split).
@rule("transpose", "permute", "unsqueeze", "squeeze", reads_blocks=True)
def dim_move(ctx: RuleContext, node: fx.Node) -> Strategy:
    x = node.args[0]
    pl = ctx.placement(x)
    src, dst = len(shape_of(x)), len(shape_of(node))
    kind = op_kind(node)
    if kind == "transpose":
        a, b = (d % src for d in node.args[1:3])
        k = b if pl.dim == a else a if pl.dim == b else pl.dim
    elif kind == "permute":
        perm = node.args[1:] if isinstance(node.args[1], int) else node.args[1]
        k = [d % src for d in perm].index(pl.dim)
    elif kind == "unsqueeze":
        u = node.args[1] % dst
        k = pl.dim + (1 if u <= pl.dim else 0)
    else:  # squeeze: which dims go depends on sizes, which the shard changes
        return fallback()
    # Moving a dim keeps its blocks: a parameter's (a fused expert weight
    # ``gate_up_proj.transpose(-2, -1)``, read by its grouped GEMM) or an activation's.
    return Strategy(out=S(k, pl.blocks))


def _of_open_parameter(ctx: RuleContext, node: fx.Node) -> bool:
    """A transpose of a parameter whose placement is still open: a 2-D one
    (``x @ self.weight.T``), or of the matrices of a 3-D stack (a MoE block's expert
    weights ``gate_up_proj.transpose(-2, -1)`` before its grouped GEMM)."""
    return (
        bool(node.args)
        and ctx.is_open(node.args[0])
        and (weight_step(node) is not None or swaps_matrices(node))
    )


def swaps_matrices(node: fx.Node) -> bool:
    """``w.transpose(-2, -1)`` (either order) of a 3-D ``w``."""
    shape = shape_of(node)
    if op_kind(node) != "transpose" or shape is None or len(shape) != 3:
        return False
    return {d % 3 for d in node.args[1:3] if isinstance(d, int)} == {1, 2}


@rule("t", "transpose", guard=_of_open_parameter, always=True)
def open_weight_transpose(ctx: RuleContext, node: fx.Node) -> Strategy:
    """Leave the parameter open: the contraction that reads this transpose places it.

    Placing it here would fix it replicated on its way to the layer (so ``x @ W.T``
    gathered, where ``F.linear(x, W)`` is split; the experts of a MoE block run whole on
    every rank); once the contraction splits the parameter, the planner's second walk
    plans this transpose of the shard.
    """
    return Strategy(out=R, keep_open=True)


@rule("t")
def transpose_2d(ctx: RuleContext, node: fx.Node) -> Strategy:
    """``x.t()``/``x.T``/``x.mT`` of a shard: a 2-D tensor's shard moves to the other dim.

    On more dims ``x.mT`` swaps the last two (``q @ k.mT``, attention scores) and
    ``x.T`` reverses every dim: a view either way, the shard follows its dim.
    """
    x = node.args[0]
    pl = ctx.placement(x)
    nd = len(shape_of(x) or ())
    if nd == 2:  # blocks and all: a fused weight's ``W.T`` (Falcon's ``x @ self.weight.T``)
        return Strategy(out=S(1 - pl.dim, pl.blocks))
    if pl.blocks:
        return fallback()
    if nd < 2:
        return Strategy(out=pl)
    attr = node.args[1] if node.target is getattr and len(node.args) == 2 else node.target
    if attr == "mT":
        swap = {nd - 1: nd - 2, nd - 2: nd - 1}
        return Strategy(out=S(swap.get(pl.dim, pl.dim)))
    if attr == "T":
        return Strategy(out=S(nd - 1 - pl.dim))
    return fallback()  # ``x.t()`` of more than 2 dims is torch's error


@rule("view_as_complex", "view_as_real")
def complex_view(ctx: RuleContext, node: fx.Node) -> Strategy:
    """The complex form of rotary embeddings (Meta's and torchtitan's Llama).

    ``view_as_complex`` pairs the last dim (size 2) into one complex element and
    ``view_as_real`` splits it back out: every other dim keeps its index and its
    size, so a shard on one of them (the heads) stays a shard on the same dim, and
    the complex multiply by a replicated ``freqs_cis`` between them is element-wise.
    Only a shard of the size-2 pair itself is not local.
    """
    pl = ctx.placement(node.args[0])
    pair = len(shape_of(node.args[0])) - 1
    if pl.blocks or (op_kind(node) == "view_as_complex" and pl.dim == pair):
        return fallback()
    return Strategy(out=S(pl.dim))


@rule("expand", "broadcast_to")
def expand(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    """``expand`` broadcasts size-1 dims and adds leading ones; a sharded dim keeps its size.

    HF's ``repeat_kv`` (``kv[:, :, None].expand(b, h_kv, n_rep, s, d)``, then a
    reshape merging ``h_kv * n_rep``) is the case that matters: the sharded
    kv-head dim is never a size-1 dim (a shard of size 1 globally cannot
    divide), so it is not broadcast, and its target size becomes -1 ("keep"),
    which is the local size on every rank. Fewer kv heads than ranks split the
    head dim instead: see :func:`_or_gathered_first`.
    """
    x = node.args[0]
    pl = ctx.placement(x)
    sizes = _sizes(node)
    out = shape_of(node)
    k = pl.dim + len(out) - len(shape_of(x))
    if len(sizes) != len(out) or node.kwargs:
        return fallback()
    new_sizes = list(sizes)
    new_sizes[k] = -1
    # ``torch.broadcast_to(x, shape)`` (Falcon's key/value groups) is ``x.expand(*shape)``
    call = Call("expand", (x, *new_sizes), {}, "call_method")
    kept = Strategy(out=S(k), call=call)
    return _or_gathered_first(ctx, node, kept)


@rule("repeat")
def repeat(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    """``x.repeat(*sizes)`` / ``x.tile(dims)``: tiles of ``x`` side by side, leading dims added.

    A shard stays a shard, on the dim it moves to, where that dim is tiled once: each
    rank's copy of its block is the block of the whole copy (a MoE's
    ``hidden.repeat(E, 1)`` of a hidden split on its features; like an expansion, it may
    be gathered before it instead: :func:`_or_gathered_first`). A dim tiled more than
    once would interleave the ranks' blocks: not local, it falls back.
    """
    x = node.args[0]
    pl, nd = ctx.placement(x), len(shape_of(x))
    sizes = _sizes(node)
    if pl.blocks or node.kwargs or not all(isinstance(n, int) for n in sizes):
        return fallback()
    sizes = (1,) * (nd - len(sizes)) + sizes  # tile's fewer dims are leading ones
    k = pl.dim + len(sizes) - nd
    return _or_gathered_first(ctx, node, Strategy(out=S(k))) if sizes[k] == 1 else fallback()


@rule("repeat_interleave")
def repeat_interleave(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    """Along any dim of a plain shard: along the head dim, local kv head ``j`` serves
    local q heads ``[j*n_rep, (j+1)*n_rep)``, so contiguous head blocks stay aligned."""
    pl = ctx.placement(node.args[0])
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if pl.blocks or dim is None:
        return fallback()
    return _or_gathered_first(ctx, node, Strategy(out=pl))


# Ops between a key/value expansion and the attention that reads it (they move no values).
_KV_PATH = ("view", "reshape", "flatten", "transpose", "permute", "t", "contiguous",
            "unsqueeze", "expand", "broadcast_to", "repeat_interleave", "repeat", "cast")  # fmt: skip
_ATTENTION = ("sdpa", "matmul", "bmm")


def _or_gathered_first(
    ctx: RuleContext, node: fx.Node, kept: Strategy
) -> Strategy | list[Strategy]:
    """``kept``, or with the alternative of gathering the input before it is repeated.

    Fewer key/value heads than ranks (multi-query attention's one) cannot split on the
    heads: the projection splits each head's dim, and the attention, whose queries are
    split on the heads, must gather the keys and values whole. Gathered after the
    expansion to every query head that sends ``n_head / n_kv`` times the bytes of
    gathering the kv heads themselves, so the planner weighs both: ``kept`` charged with
    its attention's gather of the expansion, against gathering the input first (the
    attention then slices the replicated expansion to its heads, no communication).
    Offered only where a split last (head) dim reaches attention through views alone.
    """
    x = node.args[0]
    src, out = shape_of(x), shape_of(node)
    pl = ctx.placement(x)
    if (
        src is None or out is None or pl.blocks or pl.dim != len(src) - 1
        or out[-1] != src[-1] or math.prod(out) <= math.prod(src)
        or not _reaches_attention_only(node)
    ):  # fmt: skip
        return kept
    kept.cost = cost.conversion(value_of(node), kept.out, R, ctx.p)
    kept.label = "split head dim kept (the attention gathers the expansion)"
    first = Strategy(out=R, whole=True, label="gathered before the expansion")
    return [kept, first]


def _reaches_attention_only(node: fx.Node) -> bool:
    """Every path from ``node`` runs through :data:`_KV_PATH` ops into an attention op."""
    seen, todo, found = set(), list(node.users), False
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        kind = op_kind(user)
        if kind in _ATTENTION:
            found = True
        elif kind in _KV_PATH and user.args and user.args[0] in seen | {node}:
            todo.extend(user.users)
        else:
            return False
    return found


def _keys_or_values(node: fx.Node, budget: int = 64) -> bool:
    """Every attention op ``node``'s values reach reads them as keys or values (not as its
    first operand, the queries'): query heads fewer than the ranks keep their refusal."""
    seen, todo, found = {node}, [node], False
    while todo:
        cur = todo.pop()
        for user in cur.users:
            if op_kind(user) in _ATTENTION:
                found = True
                if user.args and user.args[0] is cur:
                    return False
            elif user not in seen and user.op != "output" and len(seen) < budget:
                seen.add(user)
                todo.append(user)
            elif user not in seen:
                return False  # the graph's output, or too far to tell
    return found
