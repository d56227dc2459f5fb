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
from .core import is_cast
from .registry import Propagator, rule

_INDEX_DTYPES = (torch.int64, torch.int32)
_RESHAPES = ("view", "reshape", "flatten")
_PURE = ("clone", "contiguous", "expand")  # a dead chain of these computes nothing anyone reads


@rule("split", "chunk", reads_blocks=True)
def split(prop: Propagator, node: fx.Node) -> None:
    """chunk/split along a dim that is not the sharded one, or a blocked shard into its blocks."""
    pl = prop.placement(node.args[0])
    nd = len(shape_of(node.args[0]))
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if pl.blocks and split_sizes(node, pl.dim) == pl.blocks:
        return _split_blocks(prop, node, pl)
    if pl.blocks or dim is None or dim % nd == pl.dim:
        return prop._fallback(node)
    prop.set(node, pl)


@rule("unbind")
def unbind(prop: Propagator, node: fx.Node) -> None:
    """unbind along a dim that is not the sharded one: every piece keeps the shard.

    A fused projection viewed as ``(heads, 3, head_dim)`` and unbound into q, k, v: the
    heads stay split, each rank unbinds its own heads' triples.
    """
    x = node.args[0]
    pl = prop.placement(x)
    nd = len(shape_of(x))
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if pl.blocks or not isinstance(dim, int) or dim % nd == pl.dim:
        return prop._fallback(node)
    prop.set(node, S(pl.dim - (1 if dim % nd < pl.dim else 0)))


def _split_blocks(prop: Propagator, node: fx.Node, pl: Placement) -> None:
    """Split a blocked shard into its blocks: local sizes, plain shards out."""
    if op_kind(node) == "split":  # chunk(n) already means 1/n locally
        local = [size // prop.p for size in pl.blocks]
        kwargs = dict(node.kwargs)
        for key in ("split_size", "split_size_or_sections"):
            kwargs.pop(key, None)
        node.args, node.kwargs = (node.args[0], local, *node.args[2:]), kwargs
    prop.set(node, S(pl.dim))


@rule("getitem", reads_blocks=True)
def getitem(prop: Propagator, node: fx.Node) -> None:
    src, idx = node.args
    pl = prop.placement(src)
    if not isinstance(value_of(src), torch.Tensor):
        prop.env[node] = pl  # an element of chunk()/split(): same placement
        return
    if any(prop.placement(a) != R for a in node.all_input_nodes if a is not src):
        return prop._fallback(node)  # an index tensor that differs per rank
    idx = idx if isinstance(idx, tuple) else (idx,)
    if pl.blocks:
        return _getitem_block(prop, node, src, idx, pl)
    nd = len(shape_of(src))
    k = _dim_after_index(idx, pl.dim, nd)
    if k is None:
        # One replicated integer index tensor on another dim (a MoE block's
        # ``hidden[token_ids]``): every rank gathers the same rows of its own
        # columns, and the backward (index_put, accumulate) stays per column.
        k = _dim_after_tensor_index(idx, pl.dim, nd)
        out = shape_of(node)
        if k is None or out is None or out[k] != shape_of(src)[pl.dim]:
            return prop._fallback(node)
        # Already gathered (a MoE router read the full hidden, through its own
        # reshape and cast): index that copy, free; the rows picked (top-k: k
        # per token) would cost k times more to gather later.
        gathered = _gathered_copy(prop, src)
        if gathered is not None:
            node.replace_input_with(src, gathered)
            prop.env[node] = R
            return
    prop.set(node, S(k))


def _gathered_copy(prop: Propagator, src: fx.Node) -> fx.Node | None:
    """A replicated node the propagator made earlier that holds ``src``'s values."""
    root, shape, dtype = _same_values(src)
    return next(
        (
            g
            for (c, to), g in prop.converted.items()
            if to == R and (same := _same_values(c))[0] is root and same[1:] == (shape, dtype)
        ),
        None,
    )


def _getitem_block(
    prop: Propagator, node: fx.Node, src: fx.Node, idx: tuple, pl: Placement
) -> None:
    """A slice that is exactly one block of a blocked shard: that block's local columns."""
    nd = len(shape_of(src))
    span = last_dim_slice(idx, shape_of(src))
    starts = [sum(pl.blocks[:i]) for i in range(len(pl.blocks))]
    if (
        pl.dim != nd - 1
        or span is None
        or span not in {(a, a + size) for a, size in zip(starts, pl.blocks, strict=True)}
    ):
        return prop._fallback(node)
    start, stop = span[0] // prop.p, span[1] // prop.p
    node.args = (src, (*idx[:-1], slice(start, stop)))
    prop.set(node, S(pl.dim))


@rule("cat", "stack")
def cat(prop: Propagator, node: fx.Node) -> None:
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
    if any(prop.peek(t) == P for t in tensors):
        prop._replicate_inputs(node)
    pls = {prop.placement(t) for t in tensors}
    if pls <= {R}:  # a partial piece was all-reduced, and so was every shard with it
        prop.env[node] = R
        return
    shards = pls - {R}
    if op_kind(node) == "stack":
        # A new dim at ``dim``: never the shard dim, which moves past it. Every
        # piece the same shape, each rank stacks its own columns of each.
        if len(shards) != 1 or (pl := next(iter(shards))).blocks:
            return prop._fallback(node)
        d = dim % nd
        _shard_replicated(prop, node, tensors, pl.dim)
        return prop.set(node, S(pl.dim + (1 if pl.dim >= d else 0)))
    if len(shards) != 1 or (pl := next(iter(shards))).dim == dim % nd:
        return prop._fallback(node)
    _shard_replicated(prop, node, tensors, pl.dim)
    prop.set(node, pl)


def _shard_replicated(prop: Propagator, node: fx.Node, tensors: list[Any], dim: int) -> None:
    for t in tensors:
        if prop.placement(t) == R:
            _use_local_piece(prop, node, t, dim)


def _use_local_piece(prop: Propagator, node: fx.Node, t: fx.Node, dim: int) -> None:
    """``node`` reads :func:`_local_piece` of ``t``; a full broadcast no one reads is dropped."""
    node.replace_input_with(t, _local_piece(prop, t, dim, node))
    dead = t
    while dead.op in ("call_function", "call_method") and not dead.users and op_kind(dead) in _PURE:
        nxt = dead.args[0]
        prop.graph.erase_node(dead)  # walked already, and nothing reads it any more
        if not isinstance(nxt, fx.Node):
            break
        dead = nxt


def _local_piece(prop: Propagator, t: fx.Node, dim: int, user: fx.Node) -> Any:
    """This rank's piece of a replicated ``t`` along ``dim``: sliced, or broadcast locally.

    MLA's shared rotary key ``k_pe`` (``[b, 1, s, rope]``, replicated after the latent
    all-reduce) is expanded to every head and joined to the head-sharded keys. Slicing
    the expanded value (``scatter_to_tp``) is free forward but all-gathers
    ``[b, H, s, rope]`` in the backward; expanding ``k_pe`` to the local heads instead
    reads it through ``copy_to_tp`` (f), whose backward all-reduces ``[b, 1, s, rope]``,
    an ``H``-th of that. Same values: every head's piece is the same ``k_pe``.
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
        base is None or out is None or src.kwargs or prop.placement(base) != R
        or len(sizes) != len(out)
        or not isinstance(out[dim], int) or out[dim] % prop.p or (j >= 0 and base_shape[j] != 1)
    ):  # fmt: skip
        return prop.to_shard(t, dim, user)  # not a broadcast along dim: slice it
    local = list(sizes)
    local[dim] = out[dim] // prop.p
    with prop.graph.inserting_before(user):
        piece = prop.graph.call_method("expand", (base, *local))
    piece.meta["example_value"] = value_of(src)  # global shapes, as every node's
    prop.set(piece, S(dim))  # f on the replicated base: its gradient sums the heads' parts
    return piece


@rule("slice_scatter", "select_scatter")
def scatter(prop: Propagator, node: fx.Node) -> None:
    """``slice_scatter``/``select_scatter`` (written by ``functionalize``) off the shard dim."""
    base, src = node.args[0], node.args[1]
    if P in (prop.peek(base), prop.peek(src)):
        prop._replicate_inputs(node)
        base, src = node.args[0], node.args[1]
    nd = len(shape_of(base))
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % nd
    pb, ps = prop.placement(base), prop.placement(src)
    if pb == R and ps == R:  # a partial input was all-reduced, and the shard with it
        prop.env[node] = R
        return
    select = op_kind(node) == "select_scatter"
    k = pb.dim if pb.is_shard else ps.dim + (1 if select and ps.dim >= dim else 0)
    k_src = k - (1 if select and k > dim else 0)  # src lacks the selected dim
    if k == dim or pb.blocks or ps.blocks or pb not in (R, S(k)) or ps not in (R, S(k_src)):
        return prop._fallback(node)
    if pb == R:
        node.replace_input_with(base, prop.to_shard(base, k, node))
    if ps == R:
        _use_local_piece(prop, node, src, k_src)
    prop.set(node, S(k))


def _is_input_write(prop: Propagator, node: fx.Node) -> bool:
    return bool(node.meta.get("boost_input_write"))


@rule("copy_", guard=_is_input_write)
def input_write(prop: Propagator, node: fx.Node) -> None:
    """The ``copy_`` into a mutated graph input that ``functionalize`` appends: the full value."""
    target, value = node.args
    node.args = (target, prop.to_replicate(value, node, "input write"))
    prop.env[node] = R


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


def _same_values(node: fx.Node) -> tuple[fx.Node, tuple[Any, ...], Any]:
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
