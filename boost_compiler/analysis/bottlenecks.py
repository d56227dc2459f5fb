"""Bottleneck detection from graph structure.

A bottleneck is a path in the dataflow graph

    down: contraction of the activation's last dim, d_in -> r   (r < d_in)
    ops:  element-wise ops on the last dim, each keeping width r
    up:   contraction of that r-wide value, r -> d_out          (r < d_out)

found without looking at module or parameter names: which op contracts which
dimension with which parameter, and the fake-tensor shapes, are all it reads.
Softmax and reductions between the factors break the chain (they mix positions
of the r dim), so those pairs are not bottlenecks. Latent chains (DeepSeek's MLA,
:mod:`.latent`) are the exception the BTP layout allows: after the down factor's
all-reduce the latent is replicated, so a norm over exactly the latent dim, and a
split of it, are local and may sit between the factors (``kind="latent"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx as fx

from ..ir.op_table import op_kind
from ..ir.ops import Contraction, as_contraction, is_elementwise_on_last_dim, last_dim, op_name
from .latent import Segment, compose, is_norm, latent_step, marks_latent


@dataclass(frozen=True)
class Bottleneck:
    """One low-rank factor pair ``d_in -> rank -> d_out``.

    ``down`` and ``up`` are parameter names as in ``model.named_parameters()``;
    ``ops`` are the element-wise ops between the factors, in order.
    """

    down: str
    up: str
    d_in: int
    rank: int
    d_out: int
    ops: tuple[str, ...] = ()
    down_bias: str | None = None
    up_bias: str | None = None
    # FX node names in the graph the bottleneck was found in (for passes).
    down_node: str = ""
    up_node: str = ""
    # "pair": down -> element-wise -> up. "latent": a norm over the latent or a split of
    # it lies between (MLA); ``rank`` is still what the down factor produces, the width
    # BTP all-reduces (kv_lora_rank + rope_dim; a factored a-projection's own rank),
    # ``latent`` the width the up side reads (q_lora_rank, kv_lora_rank), and ``inner``
    # the factors between the two ends (a factored a/b projection's other half), which
    # run replicated.
    kind: str = "pair"
    latent: int | None = None
    inner: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The longest common module prefix of the two factors (for reports)."""
        a, b = self.down.split("."), self.up.split(".")
        common = []
        for x, y in zip(a[:-1], b[:-1], strict=False):
            if x != y:
                break
            common.append(x)
        return ".".join(common)


def find_bottlenecks(gm: fx.GraphModule, param_names: Mapping[str, str]) -> list[Bottleneck]:
    """All bottlenecks in one graph; ``param_names`` maps placeholder -> parameter FQN."""
    params = set(param_names)
    nodes = {n.name: n for n in gm.graph.nodes}
    contractions: dict[fx.Node, Contraction] = {}
    for node in gm.graph.nodes:
        c = as_contraction(node, params)
        if c is not None:
            contractions[node] = c

    # The "rank-space" dataflow graph: edges that carry a value of one width
    # from a contraction's output through element-wise ops into the *input*
    # operand of a contraction. A contraction appears twice, as a sink (its
    # input edge) and as a source ``("out", node)``, so a search that starts
    # at one down factor stops at the first contraction it meets. Descendants
    # of a down factor are then exactly the values its latent reaches without
    # being mixed across the r dim.
    # Latent steps (a piece of a last-dim split, a norm over the last dim) join it
    # too; a split's piece takes its edge straight from the split's input.
    def source(node: fx.Node) -> Any:
        if node in contractions:
            return ("out", node)
        if is_elementwise_on_last_dim(node) or latent_step(node) is not None:
            return node
        return None

    rank_space = nx.DiGraph()
    for node in gm.graph.nodes:
        if node in contractions:
            inputs, width = [contractions[node].input], contractions[node].d_in
        elif is_elementwise_on_last_dim(node):
            inputs, width = node.all_input_nodes, last_dim(node)
        elif (x := latent_step(node)) is not None:
            inputs, width = [x], last_dim(x)
        else:
            continue
        for src in inputs:
            if (s := source(src)) is not None and last_dim(src) == width:
                rank_space.add_edge(s, node)

    pairs: list[tuple[Segment, list[fx.Node]]] = []
    for down in contractions.values():
        r = down.d_out
        start = ("out", down.node)
        if r >= down.d_in or start not in rank_space:
            continue
        reach = nx.descendants(rank_space, start)
        for node in sorted(reach, key=_order(gm)):
            up = contractions.get(node)
            # up.d_in < r only past a split of the latent (MLA's rope part goes aside).
            if up is None or up.d_in > r or up.d_in >= up.d_out:
                continue
            path = nx.shortest_path(rank_space, start, up.node)[1:-1]
            pairs.append((Segment(down, up, tuple(_label(n) for n in path)), path))

    # Factored a/b projections: pairs joined through a latent norm (module doc of .latent).
    used = {c.node for seg, _ in pairs for c in (seg.first, seg.last)}
    singles = [c for c in contractions.values() if c.node not in used]
    chains = compose(rank_space, [seg for seg, _ in pairs], singles, params, _label)
    # A pair with a factor inside a chain is part of it; one sharing only the chain's
    # down factor (a latent read by a second up factor too) stays a pair.
    inner = {c.node for ch in chains for c in ch.inner}
    found = [
        _bottleneck(seg.first, seg.last, seg.ops, param_names, latent=_latent_of(seg, path))
        for seg, path in pairs
        if seg.first.node not in inner and seg.last.node not in inner
    ]
    found += [
        _bottleneck(ch.first, ch.last, ch.ops, param_names, latent=ch.latent, inner=ch.inner)
        for ch in chains
    ]
    order = _order(gm)  # pairs and chains in program order, as before chains existed
    return sorted(found, key=lambda b: (order(nodes[b.down_node]), order(nodes[b.up_node])))


def _latent_of(seg: Segment, path: list[fx.Node]) -> int | None:
    """The latent width of a plain walk that crossed a norm or split, else None (a pair)."""
    return seg.last.d_in if any(marks_latent(n) for n in path) else None


def _bottleneck(
    down: Contraction,
    up: Contraction,
    ops: tuple[str, ...],
    param_names: Mapping[str, str],
    latent: int | None = None,
    inner: tuple[Contraction, ...] = (),
) -> Bottleneck:
    return Bottleneck(
        down=param_names[down.weight.name],
        up=param_names[up.weight.name],
        d_in=down.d_in,
        rank=down.d_out,
        d_out=up.d_out,
        ops=ops,
        down_bias=_bias_name(down, param_names),
        up_bias=_bias_name(up, param_names),
        down_node=down.node.name,
        up_node=up.node.name,
        kind="pair" if latent is None else "latent",
        latent=latent,
        inner=tuple(param_names[c.weight.name] for c in inner),
    )


def _label(node: fx.Node) -> str:
    """A path op's name for reports: a written-out RMSNorm's scaling reads ``rms_norm``,
    a piece of a last-dim split or slice ``split``."""
    if is_norm(node) and op_name(node) == "mul":
        return "rms_norm"
    if op_kind(node) == "getitem" and latent_step(node) is not None:
        return "split"
    return op_name(node)


def _order(gm: fx.GraphModule) -> Any:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


def _bias_name(c: Contraction, param_names: Mapping[str, str]) -> str | None:
    if c.bias is not None and c.bias.op == "placeholder":
        return param_names.get(c.bias.name)
    return None
