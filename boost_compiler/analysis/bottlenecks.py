"""Bottleneck detection from graph structure.

A bottleneck is a path in the dataflow graph

    down: contraction of the activation's last dim, d_in -> r   (r < d_in)
    ops:  element-wise ops on the last dim, each keeping width r
    up:   contraction of that r-wide value, r -> d_out          (r < d_out)

found without looking at module or parameter names: which op contracts which
dimension with which parameter, and the fake-tensor shapes, are all it reads.
Norms, softmax and reductions between the factors break the chain (they mix
positions of the r dim), so those pairs are not bottlenecks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx as fx

from ..ir.ops import Contraction, as_contraction, is_elementwise_on_last_dim, last_dim, op_name


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
    def source(node: fx.Node) -> Any:
        if node in contractions:
            return ("out", node)
        return node if is_elementwise_on_last_dim(node) else None

    rank_space = nx.DiGraph()
    for node in gm.graph.nodes:
        if node in contractions:
            inputs, width = [contractions[node].input], contractions[node].d_in
        elif is_elementwise_on_last_dim(node):
            inputs, width = node.all_input_nodes, last_dim(node)
        else:
            continue
        for src in inputs:
            if (s := source(src)) is not None and last_dim(src) == width:
                rank_space.add_edge(s, node)

    found: list[Bottleneck] = []
    for down in contractions.values():
        r = down.d_out
        start = ("out", down.node)
        if r >= down.d_in or start not in rank_space:
            continue
        reach = nx.descendants(rank_space, start)
        for node in sorted(reach, key=_order(gm)):
            up = contractions.get(node)
            if up is None or up.d_in != r or r >= up.d_out:
                continue
            path = nx.shortest_path(rank_space, start, up.node)
            found.append(
                Bottleneck(
                    down=param_names[down.weight.name],
                    up=param_names[up.weight.name],
                    d_in=down.d_in,
                    rank=r,
                    d_out=up.d_out,
                    ops=tuple(op_name(n) for n in path[1:-1]),
                    down_bias=_bias_name(down, param_names),
                    up_bias=_bias_name(up, param_names),
                    down_node=down.node.name,
                    up_node=up.node.name,
                )
            )
    return found


def _order(gm: fx.GraphModule) -> Any:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


def _bias_name(c: Contraction, param_names: Mapping[str, str]) -> str | None:
    if c.bias is not None and c.bias.op == "placeholder":
        return param_names.get(c.bias.name)
    return None
