"""Graph drawings as graphviz DOT text, rendered to SVG by ``dot`` when it is installed.

Three views of one FX graph (:class:`GraphView`):

* :meth:`GraphView.layer_dot`: one layer's nodes (e.g. ``layers.0``), each
  coloured by its placement (replicated latent, replicated, hidden shard,
  partial), every collective drawn as a hexagon labelled with its kind,
  direction and payload, each bottleneck chain ``down -> ops -> up`` boxed,
  recompute regions (``node.meta["recompute"]``) outlined twice;
* :meth:`GraphView.model_dot`: the whole graph collapsed to one box per layer
  (a 48-layer model stays one readable column);
* :meth:`GraphView.full_dot`: every node, clustered by layer (for small graphs).

What each node looks like (group, category, colour) is :mod:`.node_style`'s; running
``dot`` is :mod:`.dot_render`'s. The DOT text is plain string building: no Python graphviz binding is needed,
only the ``dot`` program (Debian package ``graphviz``) for the SVGs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck
from ..ir.ops import op_name
from ..tp import collectives as C
from ..tp.collectives import Collective
from .dot_render import dot_available as dot_available
from .dot_render import dot_program as dot_program
from .dot_render import render as render
from .node_style import (
    CATEGORIES,
    CHAIN_COLOUR,
    COLLECTIVE_FILL,
    INPUTS,
    OUTPUTS,
    PLACEMENT_META,
    PRIMITIVES,
    RECOMPUTE_COLOUR,
    SAVED_COLOUR,
    TOP,
    assign_groups,
    category,
    checkpointing,
    collective_bytes,
    direction,
    dot_attrs,
    group_of_path,
    is_layer,
    payload_text,
    placement_of,
    quote,
    shape_text,
    stack_path,
)

# The names above are what the report, the dumps and the tests read from ``draw``; the
# drawing itself (GraphView) is this module's own.
__all__ = [
    "CATEGORIES", "CHAIN_COLOUR", "COLLECTIVE_FILL", "INPUTS", "OUTPUTS", "PLACEMENT_META",
    "PRIMITIVES", "RECOMPUTE_COLOUR", "SAVED_COLOUR", "TOP", "GraphView", "assign_groups",
    "category", "checkpointing", "collective_bytes", "direction", "dot_attrs",
    "dot_available", "dot_program", "group_of_path", "is_layer", "payload_text",
    "placement_of", "quote", "render", "shape_text", "stack_path",
]  # fmt: skip

log = get_logger(__name__)


# -- the views -------------------------------------------------------------------


@dataclass
class _Chain:
    label: str
    nodes: list[fx.Node]


class GraphView:
    """One graph, its layers and collectives, ready to draw.

    ``collectives``: the recorded collectives of this stage (node name -> records); when
    None they are read off the graph (:func:`~boost_compiler.tp.collectives.graph_collectives`).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        param_names: Mapping[str, str],
        buffer_names: Mapping[str, str] | None = None,
        collectives: Sequence[Collective] | None = None,
        bottlenecks: Sequence[Bottleneck] = (),
        title: str = "",
        id_prefix: str = "",
    ) -> None:
        self.gm, self.graph = gm, gm.graph
        self.param_names = dict(param_names)
        self.nodes = list(self.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.group = assign_groups(self.graph, self.param_names, buffer_names)
        records = list(C.graph_collectives(self.graph) if collectives is None else collectives)
        self.records: dict[str, list[Collective]] = defaultdict(list)
        self.stale: list[Collective] = []  # records naming a node the graph no longer has
        for c in records:
            (self.records[c.node] if c.node in self.by_name else self.stale).append(c)
        self.bottlenecks = list(bottlenecks)
        self.ranks = {b.rank for b in self.bottlenecks}
        self.title = title
        self.prefix = id_prefix

    # -- queries --

    def groups(self) -> list[str]:
        """Layer names in graph order."""
        seen: dict[str, None] = {}
        for n in self.nodes:
            seen.setdefault(self.group[n], None)
        return list(seen)

    def layers(self) -> list[str]:
        return [g for g in self.groups() if is_layer(g)]

    def members(self, group: str) -> list[fx.Node]:
        return [n for n in self.nodes if self.group[n] == group]

    def collectives_in(self, group: str) -> list[Collective]:
        return [c for n in self.members(group) for c in self.records.get(n.name, [])]

    def representative_layer(self) -> str | None:
        """The first layer with the most operations (ties: the earliest)."""
        layers = self.layers()
        if not layers:
            return None
        sizes = {g: sum(n.op != "placeholder" for n in self.members(g)) for g in layers}
        return max(layers, key=lambda g: (sizes[g], -layers.index(g)))

    def chains(self, nodes: Iterable[fx.Node]) -> list[_Chain]:
        """Bottleneck chains (down -> ... -> up) whose two ends are among ``nodes``.

        The ends are the nodes tagged ``meta["boost"] = {"role": ..., "bottleneck": i}``
        (a pass that merges factors may tag one node with a tuple of indices: the
        siblings then share one chain), else the nodes the bottleneck names.
        """
        inside = set(nodes)
        ends: dict[str, dict[int, fx.Node]] = {"down": {}, "up": {}}
        for n in self.nodes:
            tag = n.meta.get("boost")
            if not isinstance(tag, dict) or tag.get("role") not in ends:
                continue
            idx = tag.get("bottleneck")
            for i in idx if isinstance(idx, (tuple, list)) else (idx,):
                if isinstance(i, int):
                    ends[tag["role"]][i] = n
        pairs: dict[tuple[fx.Node, fx.Node], list[int]] = {}
        for i in sorted(set(ends["down"]) | set(range(len(self.bottlenecks)))):
            b = self.bottlenecks[i] if i < len(self.bottlenecks) else None
            down = ends["down"].get(i) or (self.by_name.get(b.down_node) if b else None)
            up = ends["up"].get(i) or (self.by_name.get(b.up_node) if b else None)
            if down in inside and up in inside:
                pairs.setdefault((down, up), []).append(i)
        taken: set[fx.Node] = set()
        out = []
        for (down, up), idxs in pairs.items():
            path = _between(down, up, inside) - taken
            taken |= path
            members = sorted(path, key=self.index.__getitem__)
            out.append(_Chain(self._chain_label(idxs), members))
        return out

    def _chain_label(self, idxs: list[int]) -> str:
        known = [self.bottlenecks[i] for i in idxs if i < len(self.bottlenecks)]
        if not known:
            return "bottleneck " + "+".join(map(str, idxs))
        names = "+".join(b.module.rsplit(".", 1)[-1] if b.module else "·" for b in known)
        b = known[0]
        return f"{names}: {b.d_in} → {sum(k.rank for k in known)} → {b.d_out}"

    # -- DOT pieces --

    def _id(self, node: fx.Node) -> str:
        return f"n{self.index[node]}"

    def _node_stmt(self, node: fx.Node, coll_ids: dict[int, str]) -> list[str]:
        """The node itself and, for a compound op, one hexagon per collective it holds."""
        recs = self.records.get(node.name, [])
        cat = category(node, self.ranks)
        fill = CATEGORIES[cat][0]
        pl = placement_of(node)
        where = str(pl) if pl is not None else ""
        ac = checkpointing(node)
        extra: dict[str, Any] = {}
        if ac is not None:
            kind, region = ac
            where_ac = f" (region {region})" if region is not None else ""
            if kind == "recompute":
                extra = dict(peripheries="2", color=RECOMPUTE_COLOUR, penwidth="2")
                extra["tooltip"] = f"recomputed in the backward{where_ac}"
            else:
                extra = dict(
                    color=SAVED_COLOUR, penwidth="3", tooltip=f"saved for the backward{where_ac}"
                )
        ac_class = f" {ac[0]}" if ac is not None else ""
        role = (node.meta.get("boost") or {}).get("role")
        if node.op == "placeholder":
            fqn = self.param_names.get(node.name, node.name)
            label = (
                f"{fqn.rsplit('.', 2)[-2] + '.' if fqn.count('.') else ''}{fqn.rsplit('.', 1)[-1]}"
            )
            text = f"{label}\n{shape_text(node)} {where}".rstrip()
            return [
                f"{self._id(node)} "
                + dot_attrs(label=text, shape="note", style="filled", fillcolor=fill, fontsize="9",
                         class_=f"param {cat}{ac_class}", **extra)
            ]  # fmt: skip
        lines = []
        primitive = node.op == "call_function" and node.target in PRIMITIVES
        if primitive and len(recs) == 1:
            c = recs[0]
            cid = coll_ids[id(c)]
            text = f"{op_name(node)}\n{c.kind} {direction(c)}\n{payload_text(c)}\n{collective_bytes(c):,} B"
            fc = COLLECTIVE_FILL[direction(c)]
            return [
                f"{self._id(node)} "
                + dot_attrs(label=text, shape="hexagon", style="filled,bold", fillcolor=fc,
                         fontcolor="white" if direction(c) != "bwd" else "black", id=cid,
                         class_=f"collective{ac_class}", **{"tooltip": c.reason or None, **extra})
            ]  # fmt: skip
        title = op_name(node) + (f" ({role})" if role else "")
        text = f"{title}\n{node.name}\n{shape_text(node)} {where}".rstrip()
        style = "filled,bold" if role else "filled"
        lines.append(
            f"{self._id(node)} "
            + dot_attrs(
                label=text, shape="box", style=style, fillcolor=fill, class_=cat + ac_class, **extra
            )
        )
        for c in recs:
            cid = coll_ids[id(c)]
            text = f"{c.kind} {direction(c)}\n{payload_text(c)}\n{collective_bytes(c):,} B"
            fc = COLLECTIVE_FILL[direction(c)]
            lines.append(
                f"{cid} "
                + dot_attrs(label=text, shape="hexagon", style="filled,bold", fillcolor=fc,
                         fontcolor="white" if direction(c) != "bwd" else "black", id=cid,
                         class_="collective", tooltip=c.reason or None, fontsize="9")
            )  # fmt: skip
            lines.append(f"{self._id(node)} -> {cid} [style=dashed, arrowhead=none]")
        return lines

    def _collective_ids(self, nodes: Iterable[fx.Node]) -> dict[int, str]:
        ids = {}
        for n in nodes:
            for c in self.records.get(n.name, []):
                ids[id(c)] = f"{self.prefix}coll_{len(ids)}"
        return ids

    def _header(self, name: str, title: str, rankdir: str = "TB") -> list[str]:
        return [
            f"digraph {quote(name)} {{",
            f"  graph [rankdir={rankdir}, fontname=Helvetica, fontsize=11, labelloc=t, "
            f"label={quote(title)}, nodesep=0.2, ranksep=0.3];",
            '  node [fontname=Helvetica, fontsize=10, margin="0.06,0.03"];',
            '  edge [color="#6b7280", arrowsize=0.6];',
        ]

    def layer_dot(self, layer: str, title: str | None = None) -> str:
        """The nodes of ``layer`` with their external inputs and consumers."""
        members = self.members(layer)
        inside = set(members)
        coll_ids = self._collective_ids(members)
        out = self._header(f"{self.prefix}layer", title or f"{self.title} {layer}".strip())
        chained: set[fx.Node] = set()
        for k, chain in enumerate(self.chains(members)):
            out.append(f"  subgraph cluster_chain_{k} {{")
            out.append(
                f'    graph [label={quote(chain.label)}, style="rounded,dashed", '
                f'color="{CHAIN_COLOUR}", fontcolor="{CHAIN_COLOUR}", penwidth=1.5, '
                f'id="{self.prefix}chain_{k}", class="bottleneck"];'
            )
            for n in chain.nodes:
                out += ["    " + s for s in self._node_stmt(n, coll_ids)]
                chained.add(n)
            out.append("  }")
        for n in members:
            if n not in chained:
                out += ["  " + s for s in self._node_stmt(n, coll_ids)]
        externals: dict[fx.Node, str] = {}
        sinks: dict[str, str] = {}
        for n in members:
            for a in n.all_input_nodes:
                if a in inside:
                    out.append(f"  {self._id(a)} -> {self._id(n)};")
                    continue
                if a not in externals:
                    externals[a] = f"x{self.index[a]}"
                    label = f"{a.name}\n{self.group[a]} {shape_text(a)}"
                    out.append(
                        f"  {externals[a]} "
                        + dot_attrs(label=label, shape="ellipse", style="dashed", fontsize="9",
                                 class_="external")
                    )  # fmt: skip
                out.append(f"  {externals[a]} -> {self._id(n)} [style=dashed];")
            for u in n.users:
                if u in inside:
                    continue
                g = self.group[u]
                if g not in sinks:
                    sinks[g] = f"sink{len(sinks)}"
                    out.append(
                        f"  {sinks[g]} "
                        + dot_attrs(
                            label=f"→ {g}", shape="plaintext", fontsize="9", class_="external"
                        )
                    )
                out.append(f"  {self._id(n)} -> {sinks[g]} [style=dashed];")
        out.append(self._legend())
        out.append("}")
        return "\n".join(out) + "\n"

    def model_dot(self, highlight: str | None = None, title: str | None = None) -> str:
        """One box per layer: op count, bottlenecks, collectives; edges where values flow."""
        groups = self.groups()
        gid = {g: f"g{i}" for i, g in enumerate(groups)}
        per_group: dict[str, int] = defaultdict(int)
        for b in self.bottlenecks:
            per_group[group_of_path(b.module)] += 1
        out = self._header(f"{self.prefix}model", title or f"{self.title} (one box per layer)")
        for g in groups:
            members = self.members(g)
            ops = sum(n.op not in ("placeholder", "output") for n in members)
            params = sum(n.op == "placeholder" and n.name in self.param_names for n in members)
            nb = per_group.get(g, 0)
            colls = self.collectives_in(g)
            fwd = [c for c in colls if c.forward]
            bwd = [c for c in colls if c.backward]
            lines = [g]
            if ops or params:
                lines.append(f"{ops} ops, {params} params" + (f", {nb} bottlenecks" if nb else ""))
            if colls:
                nbytes = sum(collective_bytes(c) for c in fwd) + sum(
                    collective_bytes(c) for c in bwd
                )
                lines.append(f"collectives: {len(fwd)} fwd / {len(bwd)} bwd, {nbytes:,} B")
            fill = "#ede9fe" if colls else "#f9fafb"
            bold = g == highlight
            out.append(
                f"  {gid[g]} "
                + dot_attrs(label="\n".join(lines), shape="box", style="rounded,filled" + (",bold" if bold else ""),
                         fillcolor=fill, penwidth="2.5" if bold else None, id=f"{self.prefix}layer_{gid[g]}",
                         class_="layer")
            )  # fmt: skip
        edges: set[tuple[str, str]] = set()
        for n in self.nodes:
            for a in n.all_input_nodes:
                if self.group[a] != self.group[n]:
                    edges.add((self.group[a], self.group[n]))
        fan_out: dict[str, int] = defaultdict(int)
        for ga, _ in edges:
            fan_out[ga] += 1
        for ga, gn in sorted(edges, key=lambda e: (groups.index(e[0]), groups.index(e[1]))):
            # A value every layer reads (RoPE tables, the inputs) would pull the column
            # of layers into a staircase: such edges are drawn light and do not rank.
            shared = fan_out[ga] > 3
            style = ' [constraint=false, style=dotted, color="#cbd5e1"]' if shared else ""
            out.append(f"  {gid[ga]} -> {gid[gn]}{style};")
        out.append("}")
        return "\n".join(out) + "\n"

    def full_dot(self, title: str | None = None) -> str:
        """Every node, one cluster per layer."""
        coll_ids = self._collective_ids(self.nodes)
        out = self._header(f"{self.prefix}graph", title or self.title)
        for k, g in enumerate(self.groups()):
            out.append(f"  subgraph cluster_{k} {{")
            out.append(f'    graph [label={quote(g)}, style=rounded, color="#9ca3af"];')
            for n in self.members(g):
                out += ["    " + s for s in self._node_stmt(n, coll_ids)]
            out.append("  }")
        for n in self.nodes:
            for a in n.all_input_nodes:
                out.append(f"  {self._id(a)} -> {self._id(n)};")
        out.append(self._legend())
        out.append("}")
        return "\n".join(out) + "\n"

    def _legend(self) -> str:
        rows = "".join(
            f'<TR><TD BGCOLOR="{fill}" WIDTH="14"></TD><TD ALIGN="LEFT">{text}</TD></TR>'
            for fill, text in CATEGORIES.values()
        )
        rows += (
            f'<TR><TD BGCOLOR="{COLLECTIVE_FILL["fwd"]}"></TD><TD ALIGN="LEFT">collective '
            f'(hexagon; darker: forward)</TD></TR><TR><TD BORDER="1" COLOR="{CHAIN_COLOUR}">'
            f'</TD><TD ALIGN="LEFT">bottleneck chain (dashed box)</TD></TR><TR><TD BORDER="2" '
            f'COLOR="{RECOMPUTE_COLOUR}"></TD><TD ALIGN="LEFT">recomputed in backward</TD></TR>'
            f'<TR><TD BORDER="3" COLOR="{SAVED_COLOUR}"></TD><TD ALIGN="LEFT">saved for backward'
            "</TD></TR>"
        )
        table = f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2" CELLPADDING="2">{rows}</TABLE>>'
        return f'  legend [shape=plaintext, fontsize=9, label={table}, class="legend"];'


def _between(down: fx.Node, up: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """Nodes on a dataflow path from ``down`` to ``up`` (both included), within ``inside``."""
    reach: set[fx.Node] = set()
    stack = [down]
    while stack:
        n = stack.pop()
        if n in reach or n not in inside:
            continue
        reach.add(n)
        if n is not up:
            stack.extend(n.users)
    back: set[fx.Node] = set()
    stack = [up]
    while stack:
        n = stack.pop()
        if n in back or n not in reach:
            continue
        back.add(n)
        stack.extend(n.all_input_nodes)
    return back
