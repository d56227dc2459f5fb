"""A fused projection read back by head ranges, rewritten as a split before the head view.

Falcon's multi-query attention reads its fused ``[q heads; k; v]`` projection as
``qkv.view(b, s, H + 2, hd)`` and then ``[..., :-2, :]``, ``[..., [-2], :]`` and
``[..., [-1], :]`` (its newer layout with one key/value group the same, behind a size-1
group dim; on transformers 5.25, ``split([H, 1, 1], dim=-2)``, read here as those slices). The pieces are not whole heads of a contiguous split over the ranks, so
the view cannot stay sharded. Invariant: the rewrite changes no value. Row-major, heads
``[a, b)`` of ``x.view(*lead, n, hd)`` are features ``[a*hd, b*hd)`` of ``x``, viewed, so
``x.split(sizes, -1)`` and one view per piece compute what the head slices did. The
sharding rules then see the split they already place block by block
(``rules/matrix.fused_blocks``): q on its heads, each single key/value head on its
features. Run by the ``btp`` pass before planning.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..ir.op_table import op_kind
from ..ir.ops import shape_of, value_of


def split_head_views(graph: fx.Graph) -> int:
    """Rewrite every fused output read back by head ranges; returns how many views."""
    for node in list(graph.nodes):
        _split_as_slices(graph, node)
    done = 0
    for node in list(graph.nodes):
        ranges = _head_ranges(node)
        if ranges is not None:
            _rewrite(graph, node, ranges)
            done += 1
    return done


def _head_ranges(view: fx.Node) -> dict[fx.Node, tuple[int, int]] | None:
    """Each reader's ``(start, stop)`` heads when ``view`` splits a last dim into heads
    and its readers all take contiguous head ranges that tile the heads."""
    if op_kind(view) not in ("view", "reshape") or not view.args:
        return None
    x, src, dst = view.args[0], shape_of(view.args[0]), shape_of(view)
    if not isinstance(x, fx.Node) or src is None or not dst:
        return None
    if not all(isinstance(d, int) for d in (*src, *dst)) or len(dst) < len(src) + 1:
        return None
    n, hd, ones = dst[-2], dst[-1], dst[len(src) - 1 : -2]
    if tuple(dst[: len(src) - 1]) != tuple(src[:-1]) or any(o != 1 for o in ones):
        return None
    if n * hd != src[-1] or n < 2:
        return None
    ranges = {}
    for user in view.users:
        span = _head_span(user, view, len(dst), n) if op_kind(user) == "getitem" else None
        if span is None:
            return None
        ranges[user] = span
    spans = sorted(set(ranges.values()))
    tiles = all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    if len(spans) < 2 or spans[0][0] != 0 or spans[-1][1] != n or not tiles:
        return None
    return ranges


def _split_as_slices(graph: fx.Graph, split: fx.Node) -> None:
    """``view.split(sizes, dim=-2)[i]`` (Falcon's multi-query heads on transformers 5.25)
    as the slice ``view[..., a_i:b_i, :]`` it returns, so that one form is read above."""
    if op_kind(split) != "split" or not split.args or len(split.args) > 3:
        return
    view, sizes = split.args[0], split.args[1] if len(split.args) > 1 else None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    shape = shape_of(view) if isinstance(view, fx.Node) else None
    if (
        not shape
        or not isinstance(sizes, (list, tuple))
        or not all(isinstance(n, int) for n in sizes)
    ):
        return
    if dim not in (-2, len(shape) - 2) or sum(sizes) != shape[-2]:
        return
    if set(split.kwargs) - {"dim"} or not isinstance(view, fx.Node) or op_kind(view) != "view":
        return  # only a head view's split: other splits keep the rules they have
    if not all(op_kind(u) == "getitem" and isinstance(u.args[1], int) for u in split.users):
        return
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for user in list(split.users):
        i = user.args[1]
        with graph.inserting_before(user):
            piece = graph.call_function(
                operator.getitem,
                (view, (Ellipsis, slice(starts[i], starts[i] + sizes[i]), slice(None))),
            )
        piece.meta.update(user.meta)
        user.replace_all_uses_with(piece)
        graph.erase_node(user)
    graph.erase_node(split)


def _head_span(user: fx.Node, view: fx.Node, nd: int, n: int) -> tuple[int, int] | None:
    """``(start, stop)`` when ``view[idx]`` keeps every dim whole but the heads (dim -2),
    of which it takes a step-1 slice or a one-element list (Falcon's ``[-2]``)."""
    src, idx = user.args
    if src is not view:
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(i is Ellipsis for i in idx) > 1 or any(i is None for i in idx):
        return None
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = (*idx[:at], *[slice(None)] * (nd - len(idx) + 1), *idx[at + 1 :])
    idx = (*idx, *[slice(None)] * (nd - len(idx)))
    if len(idx) != nd or any(i != slice(None) for j, i in enumerate(idx) if j != nd - 2):
        return None
    head = idx[nd - 2]
    if isinstance(head, list) and len(head) == 1 and isinstance(head[0], int):
        start = head[0] % n if -n <= head[0] < n else None
        return None if start is None else (start, start + 1)
    if not isinstance(head, slice) or head.step not in (None, 1):
        return None
    if not all(isinstance(v, int) for v in (head.start or 0, head.stop or 0)):
        return None
    start, stop, _ = head.indices(n)
    return (start, stop) if stop > start else None


def _rewrite(graph: fx.Graph, view: fx.Node, ranges: dict[fx.Node, tuple[int, int]]) -> None:
    x = view.args[0]
    dst = shape_of(view)
    hd, lead = dst[-1], dst[:-2]
    spans = sorted(set(ranges.values()))
    fake = getattr(value_of(x), "fake_mode", None)
    with graph.inserting_after(view):
        split = graph.call_function(torch.split, (x, [(b - a) * hd for a, b in spans]), {"dim": -1})
    split.meta["example_value"] = _value(fake, lambda: value_of(x).split(
        [(b - a) * hd for a, b in spans], -1))  # fmt: skip
    _copy_where(view, split)
    made: dict[tuple[int, int], fx.Node] = {}
    last = split
    for i, (a, b) in enumerate(spans):
        with graph.inserting_after(last):
            piece = graph.call_function(operator.getitem, (split, i))
        piece.meta["example_value"] = split.meta["example_value"][i]
        with graph.inserting_after(piece):
            heads = graph.call_method("view", (piece, *lead, b - a, hd))
        heads.meta["example_value"] = _value(fake, lambda p=piece, a=a, b=b: value_of(p).view(
            *lead, b - a, hd))  # fmt: skip
        for n in (piece, heads):
            _copy_where(view, n)
        made[(a, b)] = last = heads
    for user, span in ranges.items():
        user.replace_all_uses_with(made[span])
        graph.erase_node(user)
    graph.erase_node(view)


def _value(fake: Any, make: Any) -> Any:
    if fake is None:
        return make()
    with fake:
        return make()


def _copy_where(src: fx.Node, dst: fx.Node) -> None:
    """The source location and module stack of the view, for messages and drawings."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
