"""Sharding rules of indexing, splitting and joining: getitem, split/chunk, cat/stack, scatters.

Invariant: an op that selects or joins along a dim other than the shard dim
is local (each rank indexes, splits or joins its own columns; replicated
pieces are sliced to the shard first, without communication), and the shard
dim moves to where the op puts it. Selecting along the shard dim is local only
for a blocked shard read block by block (the pieces of a fused q/k/v output);
anything else along it, and any index that differs per rank, falls back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...ir.op_table import op_kind
from ...ir.ops import shape_of, value_of
from ..placement import P, Placement, R, S
from ..strategy import Call, Read, RuleContext, Strategy, fallback
from .core import is_cast
from .registry import rule

_INDEX_DTYPES = (torch.int64, torch.int32)
_RESHAPES = ("view", "reshape", "flatten")


@rule("split", "chunk", reads_blocks=True)
def split(ctx: RuleContext, node: fx.Node) -> Strategy:
    """chunk/split along a dim that is not the sharded one, or a blocked shard into its blocks."""
    pl = ctx.placement(node.args[0])
    nd = len(shape_of(node.args[0]))
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if pl.blocks and split_sizes(node, pl.dim) == pl.blocks:
        return _split_blocks(ctx, node, pl)
    if pl.blocks or dim is None or dim % nd == pl.dim:
        return fallback()
    return Strategy(out=pl)


@rule("unbind")
def unbind(ctx: RuleContext, node: fx.Node) -> Strategy:
    """unbind along a dim that is not the sharded one: every piece keeps the shard.

    A fused projection viewed as ``(heads, 3, head_dim)`` and unbound into q, k, v: the
    heads stay split, each rank unbinds its own heads' triples.
    """
    x = node.args[0]
    pl = ctx.placement(x)
    nd = len(shape_of(x))
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if pl.blocks or not isinstance(dim, int) or dim % nd == pl.dim:
        return fallback()
    return Strategy(out=S(pl.dim - (1 if dim % nd < pl.dim else 0)))


def _split_blocks(ctx: RuleContext, node: fx.Node, pl: Placement) -> Strategy:
    """Split a blocked shard into its blocks: local sizes, plain shards out."""
    s = Strategy(out=S(pl.dim))
    if op_kind(node) == "split":  # chunk(n) already means 1/n locally
        local = [size // ctx.p for size in pl.blocks]
        kwargs = dict(node.kwargs)
        for key in ("split_size", "split_size_or_sections"):
            kwargs.pop(key, None)
        s.call = Call(node.target, (node.args[0], local, *node.args[2:]), kwargs, node.op)
    return s


@rule("getitem", reads_blocks=True)
def getitem(ctx: RuleContext, node: fx.Node) -> Strategy:
    src, idx = node.args
    pl = ctx.placement(src)
    if not isinstance(value_of(src), torch.Tensor):
        return Strategy(out=pl, copy_in=False)  # an element of chunk()/split(): same placement
    if any(ctx.placement(a) != R for a in node.all_input_nodes if a is not src):
        return fallback()  # an index tensor that differs per rank
    idx = idx if isinstance(idx, tuple) else (idx,)
    if pl.blocks:
        return _getitem_block(ctx, node, src, idx, pl)
    nd = len(shape_of(src))
    k = _dim_after_index(_whole_or_empty(idx, shape_of(src), pl.dim), pl.dim, nd)
    if k is None:
        # One replicated integer index tensor on another dim (a MoE block's
        # ``hidden[token_ids]``): every rank gathers the same rows of its own
        # columns, and the backward (index_put, accumulate) stays per column.
        k = _dim_after_tensor_index(idx, pl.dim, nd)
        out = shape_of(node)
        if k is None or out is None or out[k] != shape_of(src)[pl.dim]:
            return fallback()
        # Already gathered (a MoE router read the full hidden, through its own
        # reshape and cast): index that copy, free; the rows picked (top-k: k
        # per token) would cost k times more to gather later.
        gathered = ctx.gathered(src)
        if gathered is not None:
            return Strategy(out=R, reads={src: Read(R, via=gathered)})
    return Strategy(out=S(k))


def _whole_or_empty(idx: tuple[Any, ...], shape: tuple[Any, ...], dim: int) -> tuple[Any, ...]:
    """``idx`` with a slice of dim ``dim`` that keeps all of it, or none of it, as ``:``.

    Both are local on a shard of that dim, with the index unchanged: ``k[..., :n]`` with
    ``n`` the whole (global) size keeps every local element too, ``k[..., n:]`` keeps
    none on any rank (litgpt's rotary ``x[..., :rope_n_elem]`` and the empty rest, at a
    rotary fraction of 1). Any other slice of the shard dim differs per rank.
    """
    nd, full = len(shape), shape[dim]
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    at = src = 0
    for j, i in enumerate(idx):
        if i is Ellipsis:
            src += nd - n_real
            continue
        if i is None:
            continue
        if src == dim:
            at = j
            break
        src += 1
    else:
        return idx
    i = idx[at]
    if not isinstance(i, slice) or i.step not in (None, 1) or not isinstance(full, int):
        return idx
    start, stop = i.start or 0, full if i.stop is None else i.stop
    if not (isinstance(start, int) and isinstance(stop, int)) or start < 0 or stop < 0:
        return idx
    if (start == 0 and stop >= full) or start >= full:
        return (*idx[:at], slice(None), *idx[at + 1 :])
    return idx


def _getitem_block(
    ctx: RuleContext, node: fx.Node, src: fx.Node, idx: tuple, pl: Placement
) -> Strategy:
    """A slice that is exactly one block of a blocked shard: that block's local columns."""
    nd = len(shape_of(src))
    span = last_dim_slice(idx, shape_of(src))
    starts = [sum(pl.blocks[:i]) for i in range(len(pl.blocks))]
    if (
        pl.dim != nd - 1
        or span is None
        or span not in {(a, a + size) for a, size in zip(starts, pl.blocks, strict=True)}
    ):
        return fallback()
    start, stop = span[0] // ctx.p, span[1] // ctx.p
    call = Call(node.target, (src, (*idx[:-1], slice(start, stop))), dict(node.kwargs), node.op)
    return Strategy(out=S(pl.dim), call=call)


@rule("cat", "stack")
def cat(ctx: RuleContext, node: fx.Node) -> Strategy:
    """Concatenation along a dim other than the shard dim stays sharded.

    Replicated pieces are sliced to the same shard (no communication), so
    a cache of past keys (replicated input) joins this step's head-sharded
    keys. 1-D empty tensors are skipped by ``torch.cat`` whatever the other
    pieces' rank (HF's empty ``DynamicCache`` layers start as ``tensor([])``);
    they stay in the arguments and are skipped locally too.
    """
    tensors = [t for t in node.args[0] if not _legacy_empty(t)]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    nd = len(shape_of(node))
    if any(ctx.peek(t) == P for t in tensors):
        return Strategy(out=R, whole=True)  # every shard read whole with the partial piece
    pls = {ctx.placement(t) for t in tensors}
    if pls <= {R}:
        return Strategy(out=R)
    shards = pls - {R}
    if op_kind(node) == "stack":
        # A new dim at ``dim``: never the shard dim, which moves past it. Every
        # piece the same shape, each rank stacks its own columns of each.
        if len(shards) != 1 or (pl := next(iter(shards))).blocks:
            return fallback()
        d = dim % nd
        s = Strategy(out=S(pl.dim + (1 if pl.dim >= d else 0)))
        return _shard_replicated(ctx, s, tensors, pl.dim)
    alone = _only_nonempty(ctx, tensors, dim % nd)
    if alone is not None:
        return Strategy(out=alone)
    if len(shards) != 1 or (pl := next(iter(shards))).dim == dim % nd:
        return fallback()
    return _shard_replicated(ctx, Strategy(out=pl), tensors, pl.dim)


def _only_nonempty(ctx: RuleContext, tensors: list[Any], dim: int) -> Placement | None:
    """The placement of the one piece not empty along ``dim``, when it is a plain shard of
    ``dim`` and every other piece is empty there (size 0 locally too, whatever its
    placement): the join is that piece, on every rank (a rotary over the whole head
    joined to the empty rest of it)."""
    sizes = [(shape_of(t) or ())[dim : dim + 1] for t in tensors]
    kept = [t for t, size in zip(tensors, sizes, strict=True) if size != (0,)]
    if len(kept) != 1 or any(not size for size in sizes):
        return None
    pl = ctx.placement(kept[0])
    return pl if pl.is_shard and pl.dim == dim and not pl.blocks else None


def _shard_replicated(ctx: RuleContext, s: Strategy, tensors: list[Any], dim: int) -> Strategy:
    for t in tensors:
        if isinstance(t, fx.Node) and ctx.placement(t) == R:
            s.reads[t] = local_piece(ctx, t, dim)
    return s


def local_piece(ctx: RuleContext, t: fx.Node, dim: int) -> Read:
    """How to read this rank's piece of a replicated ``t`` along ``dim``: sliced, or
    broadcast locally.

    MLA's shared rotary key ``k_pe`` (``[b, 1, s, rope]``, replicated after the latent
    all-reduce) is expanded to every head and joined to the head-sharded keys. Slicing
    the expanded value (``scatter_to_tp``) is free forward but all-gathers
    ``[b, H, s, rope]`` in the backward; expanding ``k_pe`` to the local heads instead
    reads it through ``copy_to_tp`` (f), whose backward all-reduces ``[b, 1, s, rope]``,
    an ``H``-th of that. Same values: every head's piece is the same ``k_pe``. (The
    applier drops the full broadcast if no one else reads it.)
    """
    src = t
    while op_kind(src) in ("clone", "contiguous") and len(src.all_input_nodes) == 1:
        src = src.args[0]
    base, out = (src.args[0] if op_kind(src) == "expand" else None), shape_of(src)
    base_shape = shape_of(base)
    sizes = src.args[1:] if base is not None else ()
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    j = dim - (len(out) - len(base_shape)) if base_shape and out else -1
    if (
        base is None or out is None or src.kwargs or ctx.placement(base) != R
        or len(sizes) != len(out)
        or not isinstance(out[dim], int) or out[dim] % ctx.p or (j >= 0 and base_shape[j] != 1)
    ):  # fmt: skip
        return Read(S(dim))  # not a broadcast along dim: slice it
    local = list(sizes)
    local[dim] = out[dim] // ctx.p
    return Read(S(dim), expand=(base, tuple(local)))


@rule("slice_scatter", "select_scatter")
def scatter(ctx: RuleContext, node: fx.Node) -> Strategy:
    """``slice_scatter``/``select_scatter`` (written by ``functionalize``) off the shard dim."""
    base, src = node.args[0], node.args[1]
    if P in (ctx.peek(base), ctx.peek(src)):
        # Summed first: then a shard read whole with it, and the op on full values.
        return Strategy(out=R, whole=True)
    nd = len(shape_of(base))
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % nd
    pb, ps = ctx.placement(base), ctx.placement(src)
    if pb == R and ps == R:
        return Strategy(out=R)
    select = op_kind(node) == "select_scatter"
    k = pb.dim if pb.is_shard else ps.dim + (1 if select and ps.dim >= dim else 0)
    k_src = k - (1 if select and k > dim else 0)  # src lacks the selected dim
    if k == dim or pb.blocks or ps.blocks or pb not in (R, S(k)) or ps not in (R, S(k_src)):
        return fallback()
    s = Strategy(out=S(k))
    if pb == R:
        s.read(base, S(k))
    if ps == R and isinstance(src, fx.Node):
        s.reads[src] = local_piece(ctx, src, k_src)
    return s


def _is_input_write(ctx: RuleContext, node: fx.Node) -> bool:
    return bool(node.meta.get("boost_input_write"))


@rule("copy_", guard=_is_input_write)
def input_write(ctx: RuleContext, node: fx.Node) -> Strategy:
    """The ``copy_`` into a mutated graph input that ``functionalize`` appends: the full value."""
    target, value = node.args
    return Strategy(out=R).read(value, R, "input write")


# -- index geometry ----------------------------------------------------------------


def split_sizes(node: fx.Node, dim: int) -> tuple[int, ...] | None:
    """The global piece sizes when ``node`` splits or chunks along ``dim``, else None."""
    if op_kind(node) not in ("split", "chunk"):
        return None
    pieces = value_of(node)
    if not isinstance(pieces, (tuple, list)) or not pieces:
        return None
    nd = pieces[0].dim()
    given = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if not isinstance(given, int) or given % nd != dim % nd:
        return None
    sizes = tuple(t.shape[dim] for t in pieces)
    return sizes if all(isinstance(size, int) for size in sizes) else None


def last_dim_slice(idx: tuple[Any, ...], shape: tuple[Any, ...]) -> tuple[int, int] | None:
    """``(start, stop)`` when ``x[idx]`` only slices the last dim, with static bounds."""
    nd, full = len(shape), shape[-1]
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = (*idx[:at], *[slice(None)] * (nd - len(idx) + 1), *idx[at + 1 :])
    if len(idx) != nd or any(i != slice(None) for i in idx[:-1]):
        return None
    last = idx[-1]
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    start, stop = last.start or 0, full if last.stop is None else last.stop
    if not all(isinstance(v, int) for v in (start, stop, full)) or start < 0 or stop < 0:
        return None
    return start, min(stop, full)


def sliced_blocks(node: fx.Node, dim: int) -> tuple[int, ...] | None:
    """Block sizes when every user slices ``node``'s last dim and the slices tile it."""
    full = shape_of(node)[dim]
    spans = set()
    for user in node.users:
        if op_kind(user) != "getitem" or user.args[0] is not node:
            return None
        idx = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
        span = last_dim_slice(idx, shape_of(node))
        if span is None:
            return None
        spans.add(span)
    ordered = sorted(spans)
    if not ordered or ordered[0][0] != 0 or ordered[-1][1] != full:
        return None
    if any(a[1] != b[0] for a, b in zip(ordered, ordered[1:], strict=False)):
        return None
    return tuple(b - a for a, b in ordered)


def _dim_after_index(idx: tuple[Any, ...], dim: int, nd: int) -> int | None:
    """Where dim ``dim`` goes after ``x[idx]``; None if the index touches it."""
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (nd - n_real))
        else:
            expanded.append(i)
    out = src = 0
    for i in expanded:
        if i is None:
            out += 1
            continue
        if src == dim:
            return out if i == slice(None) else None
        if isinstance(i, int):
            src += 1
            continue
        if isinstance(i, slice):
            src += 1
            out += 1
            continue
        return None  # tensor indexing
    return out + (dim - src)


def _dim_after_tensor_index(idx: tuple[Any, ...], dim: int, nd: int) -> int | None:
    """Where dim ``dim`` goes after ``x[idx]`` when ``idx`` is one integer index tensor
    on another dim and full slices elsewhere (its dims replace the indexed one in
    place); None for anything else (masks, several tensors, ``None``, ints)."""
    if None in idx or sum(i is Ellipsis for i in idx) > 1:
        return None
    n_real = sum(1 for i in idx if i is not Ellipsis)
    expanded: list[Any] = []
    for i in idx:
        expanded.extend([slice(None)] * (nd - n_real) if i is Ellipsis else [i])
    expanded.extend([slice(None)] * (nd - len(expanded)))
    tensors = [j for j, i in enumerate(expanded) if isinstance(i, fx.Node)]
    if len(expanded) != nd or len(tensors) != 1:
        return None
    [at] = tensors
    index = value_of(expanded[at])
    if (
        at == dim
        or not isinstance(index, torch.Tensor)
        or index.dtype not in _INDEX_DTYPES
        or any(i != slice(None) for j, i in enumerate(expanded) if j != at)
    ):
        return None
    return dim if dim < at else dim + index.dim() - 1


def same_values(node: fx.Node) -> tuple[fx.Node, tuple[Any, ...], Any]:
    """``(root, shape, dtype)``: equal for two nodes that hold the same values.

    ``root`` is reached through reshapes (row-major: the values depend only on the
    input and the shape), ``contiguous`` and casts to the dtype the tensor already
    has; anything else is a root.
    """
    shape, dtype = tuple(shape_of(node) or ()), getattr(value_of(node), "dtype", None)
    while node.op in ("call_function", "call_method") and node.args:
        src = node.args[0]
        if not isinstance(src, fx.Node) or getattr(value_of(src), "dtype", None) != dtype:
            break
        if not (op_kind(node) in (*_RESHAPES, "contiguous") or is_cast(node)):
            break
        node = src
    return node, shape, dtype


def _legacy_empty(arg: Any) -> bool:
    """A 1-D tensor of size 0: ``torch.cat`` skips it, whatever the other pieces' rank."""
    return shape_of(arg) == (0,)
