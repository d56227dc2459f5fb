"""Latent chains: bottlenecks with a norm (or a split) over the latent, as in DeepSeek's MLA.

DeepSeek-V2/V3 multi-head latent attention projects the hidden to narrow latents,
normalises them and widens them again (BOOST.md, "Latent attention is a bottleneck
too"):

    q_a_proj (d -> q_lora_rank) -> RMSNorm(q_lora_rank) -> q_b_proj (-> heads * qk_dim)
    kv_a_proj_with_mqa (d -> kv_lora_rank + rope) -> split -> RMSNorm(kv_lora_rank)
        -> kv_b_proj (-> heads * (nope + v))

Under BTP the value after the down factor's all-reduce is replicated, so a norm
whose normalised dim is that latent dim is computed locally by every rank, and a
split of the latent's last dim is local too. This module holds the two pieces
:func:`~boost_compiler.analysis.bottlenecks.find_bottlenecks` adds for them:

* :func:`latent_step`: the ops through which a latent keeps its per-token,
  last-dim-local meaning besides element-wise ones (pieces of a last-dim split or
  slice, ``rms_norm``/``layer_norm`` over exactly the last dim), so a plain walk
  from ``kv_a_proj_with_mqa`` reaches ``kv_b_proj``;
* :func:`compose`: when ``to_low_rank`` has factored the a/b projections
  themselves (``q_a_proj = up(silu(down(x)))``), the pairs on both sides of the
  norm are joined into one chain ``q_a.down -> ... -> q_b.up``. The cut moves to
  the narrowest point (the a-projection's own rank), and everything between runs
  replicated: one all-reduce instead of two. Joined only when the link between
  the pairs is latent-local: a norm or a split on it, the latent narrower than
  both the chain's input and output, every other operand a parameter or computed
  from the latent itself. A norm over the hidden (``o.up -> norm -> q.down``, or
  ``down.up -> residual add -> norm -> q.down``, where the residual is another
  activation) or an MLP's product of two branches is never joined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from ..ir.op_table import op_kind
from ..ir.ops import Contraction, last_dim, shape_of, value_of

_NORMS = ("rms_norm", "layer_norm")


def latent_step(node: fx.Node) -> fx.Node | None:
    """The input whose latent ``node`` carries on, last-dim-locally; None if it is no step.

    A piece of a split/chunk along the last dim (the ``getitem`` of it), a slice of
    the last dim only, or a norm over exactly the last dim. Their width may shrink
    (a piece), never mix positions of another token or another feature's meaning.
    """
    kind = op_kind(node)
    if kind in _NORMS:
        x = node.args[0] if node.args else None
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        if isinstance(x, fx.Node) and _one_dim(shape) == last_dim(x):
            return x
        return None
    if kind != "getitem" or not isinstance(node.args[0], fx.Node):
        return None
    src, idx = node.args
    if op_kind(src) in ("split", "chunk") and isinstance(idx, int):
        x = src.args[0]
        dim = src.kwargs.get("dim", src.args[2] if len(src.args) > 2 else 0)
        nd = len(shape_of(x) or ())
        return (
            x
            if isinstance(x, fx.Node) and nd and isinstance(dim, int) and dim % nd == nd - 1
            else None
        )
    return src if _last_dim_slice(idx, len(shape_of(src) or ())) else None


def is_norm(node: fx.Node) -> bool:
    """A norm on the path: a built-in one, or the ``x * rsqrt(stat)`` of a written-out RMSNorm."""
    if op_kind(node) in _NORMS:
        return True
    return op_kind(node) == "mul" and any(
        op_kind(a) == "rsqrt" and last_dim(a) == 1 for a in node.all_input_nodes
    )


def marks_latent(node: fx.Node) -> bool:
    """Ops whose presence between two factors makes the pair a latent chain (for reports)."""
    return is_norm(node) or (latent_step(node) is not None and op_kind(node) == "getitem")


@dataclass(frozen=True)
class Segment:
    """A piece a chain is built from: a factor pair (``first`` -> ``last``) or one contraction."""

    first: Contraction
    last: Contraction
    ops: tuple[str, ...] = ()  # between first and last (a pair's activation)

    @property
    def d_in(self) -> int:
        return self.first.d_in

    @property
    def d_out(self) -> int:
        return self.last.d_out


@dataclass(frozen=True)
class Chain:
    """Segments joined by latent-local links: its contractions in order, the ops between."""

    contractions: tuple[Contraction, ...]  # first: the chain's down factor, last: its up
    ops: tuple[str, ...]
    latent: int  # the width the last segment reads (q_lora_rank, kv_lora_rank)

    @property
    def first(self) -> Contraction:
        return self.contractions[0]

    @property
    def last(self) -> Contraction:
        return self.contractions[-1]

    @property
    def inner(self) -> tuple[Contraction, ...]:
        """The contractions between the ends: they run replicated, with no role."""
        return self.contractions[1:-1]


def compose(
    rank_space: nx.DiGraph,
    pairs: Sequence[Segment],
    singles: Iterable[Contraction],
    params: set[str],
    label: Callable[[fx.Node], str],
) -> list[Chain]:
    """Chains of two or more segments, at least one of them a factor pair (see the module doc).

    ``pairs`` are the plain bottlenecks found so far, ``singles`` the contractions in
    none of them. A link ``a -> b`` needs ``b.first`` reachable from ``a.last``'s output
    in ``rank_space`` along a latent-local path with a norm or a split on it, the
    latent narrower than ``a``'s input and ``b``'s output.
    """
    segments = [*pairs, *(Segment(c, c) for c in singles)]
    n_pairs = len(pairs)
    by_first = {s.first.node: i for i, s in enumerate(segments)}
    links: dict[int, list[tuple[int, tuple[str, ...]]]] = {}
    incoming: set[int] = set()
    for i, a in enumerate(segments):
        start = ("out", a.last.node)
        w = a.last.d_out
        if start not in rank_space or w >= a.d_in:
            continue
        for node in nx.descendants(rank_space, start):
            j = by_first.get(node)
            if j is None or j == i or (i >= n_pairs and j >= n_pairs):
                continue  # two single contractions: a plain bottleneck, found already
            b = segments[j]
            if w >= b.d_out or b.first.d_in >= b.d_out:
                continue
            path = nx.shortest_path(rank_space, start, node)[1:-1]
            if not any(marks_latent(n) for n in path) or not _local(a.last.node, path, params):
                continue
            links.setdefault(i, []).append((j, tuple(label(n) for n in path)))
            incoming.add(j)

    chains: list[Chain] = []

    def walk(done: tuple[int, ...], gaps: tuple[tuple[str, ...], ...]) -> None:
        nxt = [(j, g) for j, g in links.get(done[-1], []) if j not in done]
        if not nxt:
            chains.append(_chain([segments[k] for k in done], gaps, label))
        for j, gap in nxt:
            walk((*done, j), (*gaps, gap))

    for i in sorted(set(links) - incoming):
        walk((i,), ())
    return chains


def _chain(segments: list[Segment], gaps: tuple[tuple[str, ...], ...], label: Any) -> Chain:
    """The chain's contractions in order and the ops strictly between its two ends."""
    cs: list[Contraction] = []
    between: list[tuple[str, ...]] = []
    for i, seg in enumerate(segments):
        if i:
            between.append(gaps[i - 1])
        cs.append(seg.first)
        if seg.last is not seg.first:
            between.append(seg.ops)
            cs.append(seg.last)
    ops = list(between[0])
    for j in range(1, len(cs) - 1):
        ops += [label(cs[j].node), *between[j]]
    return Chain(tuple(cs), tuple(ops), segments[-1].first.d_in)


def _local(start: fx.Node, path: list[fx.Node], params: set[str], depth: int = 8) -> bool:
    """Every operand of the path is on it, a parameter, a constant, or computed from the path.

    The norm's statistics (``rsqrt(mean(x**2) + eps)``) are computed from the path;
    a residual stream or another branch's activation is not: such a link is no latent.
    """
    on_path = {start, *path}
    memo: dict[fx.Node, bool] = {}

    def derived(n: fx.Node, d: int) -> bool:
        if n in on_path or isinstance(value_of(n), (int, float, torch.SymInt, torch.SymFloat)):
            return True  # a size (SymInt under dynamic shapes) carries no values
        if n not in memo:
            if n.op == "placeholder":
                memo[n] = n.name in params
            elif n.op == "get_attr":
                memo[n] = True
            elif d >= depth:
                memo[n] = False
            else:  # a factory op (no inputs) is a constant
                memo[n] = all(derived(a, d + 1) for a in n.all_input_nodes)
        return memo[n]

    return all(derived(a, 0) for n in path for a in n.all_input_nodes)


def _one_dim(shape: Any) -> Any:
    if isinstance(shape, (list, tuple)) and len(shape) == 1:
        return shape[0]
    return shape if isinstance(shape, int) else None


def _last_dim_slice(idx: Any, nd: int) -> bool:
    """``x[..., a:b]`` or ``x[:, :, a:b]``: a slice of the last dim, full slices elsewhere."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not nd or not idx or not isinstance(idx[-1], slice):
        return False
    head = idx[:-1]
    if head == (Ellipsis,):
        return True
    return len(idx) == nd and all(i == slice(None) for i in head)
