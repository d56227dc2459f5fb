"""The one applier: rewrite a graph for one rank from its planned strategies.

Invariant: this is the only code that changes a graph for tensor parallelism. Given
every node's :class:`~boost_compiler.tp.strategy.Strategy` (decided by the planner,
which changed nothing), it walks the graph once, in order, and for each node inserts
the conversions its reads need, rewrites its call to the local one, converts a partial
result right after it, and puts ``f`` (:func:`~boost_compiler.tp.collectives.copy_to_tp`)
on the replicated inputs that need grad of a rank-varying node. Five conversions are
enough, and each has the backward that keeps gradients exact (``collectives.py``)::

    P -> R   reduce_from_tp  (g)      S -> R   gather_from_tp
    R -> S   scatter_to_tp            P -> S   reduce_scatter_to_tp
    R into a rank-varying op: copy_to_tp (f)

A conversion is made once per value and placement and shared by its readers. Graph
outputs are read whole, so what leaves a graph (and crosses a graph break) is global.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from ..ir.op_table import op_kind
from ..ir.ops import value_of
from ..ir.subgraphs import drop_unused_bodies, free_name
from . import collectives as C
from .copy_site import copy_site
from .placement import P, Placement, R, S, rank_major, unblock
from .planner import Walk
from .regions import CallPlan
from .rules.core import requires_grad
from .rules.registry import ShardingResult
from .strategy import Read, Strategy

_F = Placement("F")  # the key of an f conversion (not a placement a value has)
_PURE = ("clone", "contiguous", "expand")  # a dead chain of these computes nothing anyone reads


class Applier:
    """Rewrites ``graph`` in place for one rank from ``plan`` (node -> strategy)."""

    def __init__(
        self, graph: fx.Graph, env: dict[fx.Node, Placement], group: str, rank: int, p: int
    ) -> None:
        self.graph, self.group, self.rank, self.p = graph, group, rank, p
        self.env = dict(env)  # the planned placements; conversion nodes are added as made
        self.alias: dict[fx.Node, fx.Node] = {}  # a node -> what its readers read instead
        self.origin: dict[fx.Node, fx.Node] = {}  # and back: what the strategies call it
        self.converted: dict[tuple[fx.Node, Placement], fx.Node] = {}
        self.bodies: dict[str, fx.Node] = {}  # region bodies installed: attribute -> get_attr

    def run(self, plan: dict[fx.Node, Strategy]) -> None:
        for node in list(self.graph.nodes):
            s = plan.get(node)
            if s is not None and not node._erased:
                self._apply(node, s)
        for node, pl in self.env.items():  # for drawings and dumps (boost explain)
            if not node._erased and node.op != "output":
                node.meta["boost_placement"] = pl

    # -- one node ----------------------------------------------------------

    def _apply(self, node: fx.Node, s: Strategy) -> None:
        if s.fuse is not None:
            return self._fuse(node, s)
        if s.call is not None:
            node.op, node.target = s.call.op, s.call.target
            node.args, node.kwargs = s.call.args, dict(s.call.kwargs)
        self._convert_inputs(node, s)
        self.env[node] = s.out
        if s.rank_varying:
            self._copy_in(node)
        if s.then is not None:
            self._then(node, s)
        if s.body is not None:
            self._install(node, s.body)

    def _install(self, call: fx.Node, plan: CallPlan) -> None:
        """A region call runs the body rewritten for its key, under that body's identifier."""
        body, gm = plan.body, self.graph.owning_module
        assert gm is not None, "a region call outside a GraphModule"
        if getattr(gm, body.attr, None) is not body.body:
            gm.register_module(body.attr, body.body)  # the first key takes the original's place
        holder = self.bodies.get(body.attr)
        if holder is None:
            with self.graph.inserting_before(call):
                holder = self.bodies[body.attr] = self.graph.get_attr(body.attr)
        call.args = (holder, body.identifier, *call.args[2:])

    def _convert_inputs(self, node: fx.Node, s: Strategy) -> None:
        for arg in list(node.all_input_nodes):
            read = s.reads.get(self.origin.get(arg, arg))
            cur = self.alias.get(arg, arg)
            if read is None and s.whole:
                read = Read(R)
            new = self.read(cur, read, node) if read is not None else cur
            if new is not arg:
                node.replace_input_with(arg, new)
            if read is not None and read.expand is not None:
                self._drop_dead(cur)

    def _drop_dead(self, dead: Any) -> None:
        """A full broadcast no one reads any more, and the pure chain that made it."""
        while (
            isinstance(dead, fx.Node) and dead.op in ("call_function", "call_method")
            and not dead.users and op_kind(dead) in _PURE
        ):  # fmt: skip
            nxt = dead.args[0]
            self.graph.erase_node(dead)  # applied already, and nothing reads it any more
            self.env.pop(dead, None)
            dead = nxt

    def read(self, arg: fx.Node, read: Read, user: fx.Node) -> fx.Node:
        """``arg`` as ``read`` asks, converting (once per value and placement) if needed."""
        if read.expand is not None:
            return self._expand_piece(arg, read, user)
        if read.via is not None:
            return self.converted[(self.alias.get(read.via, read.via), read.placement)]
        if read.placement == R:
            return self.to_replicate(arg, user, read.reason)
        if read.placement.is_shard:
            pl = read.placement
            return self.to_shard(arg, pl.dim, user, read.reason, pl.blocks)
        return arg  # P: a partial read as is (only its own conversion reads it)

    def _then(self, node: fx.Node, s: Strategy) -> None:
        """Convert the partial result at once, add its bias, and give readers the result."""
        assert s.then is not None
        to = s.then.to
        out = (
            self.to_replicate(node, node, s.then.reason)
            if to == R
            else self.to_shard(node, to.dim, node, s.then.reason)
        )
        made = {out}
        if s.then.bias is not None:
            bias = self.alias.get(s.then.bias, s.then.bias)
            bias = self.to_replicate(bias, node, f"{s.then.reason} bias") if to == R else (
                self.to_shard(bias, 0, node))  # fmt: skip
            with self.graph.inserting_after(out):
                added = self.graph.call_function(operator.add, (out, bias))
            added.meta["example_value"] = value_of(node)  # global shapes, as every node's
            self.env[added] = to
            made.add(added)
            out = added
        self._rewire(node, out, made)

    def _rewire(self, node: fx.Node, out: fx.Node, made: set[fx.Node]) -> None:
        for user in list(node.users):
            if user not in made:
                user.replace_input_with(node, out)
        self.alias[node], self.origin[out] = out, node

    def _fuse(self, node: fx.Node, s: Strategy) -> None:
        assert s.fuse is not None and s.call is not None
        end = s.fuse.end
        with self.graph.inserting_before(end):
            args = tuple(self._submodule(a) for a in s.call.args)
            new = self.graph.create_node(s.call.op, s.call.target, args, dict(s.call.kwargs))
        new.meta = dict(end.meta)
        self._convert_inputs(new, s)
        end.replace_all_uses_with(new)
        for n in reversed(s.fuse.chain):
            self.graph.erase_node(n)
            self.env.pop(n, None)
        for n in s.fuse.dead:
            if not n.users:
                self.graph.erase_node(n)
                self.env.pop(n, None)
        self.env[new] = s.out
        if s.rank_varying:
            self._copy_in(new)
        self.alias[end], self.origin[new] = new, end

    def _submodule(self, arg: Any) -> Any:
        """A sub-graph argument (the stretch a call runs inside, ``rules/expert_parallel``)
        installed on the graph's module and read by ``get_attr``; other arguments as they are."""
        if not isinstance(arg, fx.GraphModule):
            return arg
        gm = self.graph.owning_module
        assert gm is not None, "a sub-graph argument outside a GraphModule"
        name = free_name(gm, "boost_experts")
        gm.register_module(name, arg)
        return self.graph.get_attr(name)

    # -- conversions -------------------------------------------------------

    def to_replicate(self, arg: Any, user: fx.Node, reason: str = "") -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        pl = self.env.get(arg, R)
        if pl == R:
            return arg
        key = (arg, R)
        if key not in self.converted:
            with self.graph.inserting_after(arg):
                if pl == P:
                    new = self.graph.call_function(C.reduce_from_tp, (arg, self.group))
                else:
                    new = self.graph.call_function(
                        C.gather_from_tp, (arg, pl.dim, self.group, self.rank, self.p)
                    )
            # Why it communicates (else: for which consumer), read with the graph's collectives.
            new.meta[C.WHY_META] = reason or user.name
            if pl.blocks:  # rank-major after the gather; put each block back together
                gathered = new
                with self.graph.inserting_after(gathered):
                    new = self.graph.call_function(unblock, (gathered, pl.dim, pl.blocks, self.p))
                gathered.meta["example_value"] = value_of(arg)
            new.meta["example_value"] = value_of(arg)
            self.env[new] = R
            self.converted[key] = new
        return self.converted[key]

    def to_shard(
        self, arg: Any, dim: int, user: fx.Node, reason: str = "", blocks: tuple[int, ...] = ()
    ) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        pl = self.env.get(arg, R)
        if pl == S(dim, blocks):
            return arg
        if blocks:
            return self._to_blocks(arg, S(dim, blocks), user, reason)
        if pl == P:  # partial sums to shards: one reduce-scatter, not all-reduce + slice
            key = (arg, S(dim))
            if key not in self.converted:
                with self.graph.inserting_after(arg):
                    new = self.graph.call_function(
                        C.reduce_scatter_to_tp, (arg, dim, self.group, self.rank, self.p)
                    )
                new.meta["example_value"] = value_of(arg)
                if reason:
                    new.meta[C.WHY_META] = reason
                self.env[new] = S(dim)
                self.converted[key] = new
            return self.converted[key]
        if pl != R:
            arg = self.to_replicate(arg, user, reason or "reshard")
        key = (arg, S(dim))
        if key not in self.converted:
            with self.graph.inserting_after(arg):
                new = self.graph.call_function(
                    C.scatter_to_tp, (arg, dim, self.group, self.rank, self.p)
                )
            self.env[new] = S(dim)
            self.converted[key] = new
        return self.converted[key]

    def _to_blocks(self, arg: fx.Node, want: Placement, user: fx.Node, reason: str) -> fx.Node:
        """Read as a blocked shard: the whole value reordered rank-major, then scattered."""
        if self.env.get(arg, R) != R:
            arg = self.to_replicate(arg, user, reason or "reshard")
        key = (arg, want)
        if key not in self.converted:
            with self.graph.inserting_after(arg):
                ordered = self.graph.call_function(rank_major, (arg, want.dim, want.blocks, self.p))
            ordered.meta["example_value"] = value_of(arg)
            self.env[ordered] = R
            with self.graph.inserting_after(ordered):
                new = self.graph.call_function(
                    C.scatter_to_tp, (ordered, want.dim, self.group, self.rank, self.p)
                )
            new.meta["example_value"] = value_of(arg)
            self.env[new] = want
            self.converted[key] = new
        return self.converted[key]

    def _copy_in(self, node: fx.Node) -> None:
        """f on every replicated input that requires grad of a rank-varying node (or on
        the smaller value it was gathered from: ``copy_site``)."""
        for arg in node.all_input_nodes:
            if self.env.get(arg, R) == R and requires_grad(arg):
                reader, src = copy_site(arg, node, lambda _, a: self.env.get(a, R))
                key = (src, _F)
                if key not in self.converted:
                    with self.graph.inserting_after(src):
                        new = self.graph.call_function(C.copy_to_tp, (src, self.group))
                    self.env[new] = R
                    self.converted[key] = new
                reader.replace_input_with(src, self.converted[key])

    def _expand_piece(self, t: fx.Node, read: Read, user: fx.Node) -> fx.Node:
        """This rank's piece of a broadcast, made locally; the full broadcast, if now unread,
        is dropped with the pure chain that made it."""
        assert read.expand is not None
        base, local = read.expand
        with self.graph.inserting_before(user):
            piece = self.graph.call_method("expand", (self.alias.get(base, base), *local))
        src = t
        while op_kind(src) in ("clone", "contiguous") and len(src.all_input_nodes) == 1:
            src = src.args[0]
        piece.meta["example_value"] = value_of(src)  # global shapes, as every node's
        self.env[piece] = read.placement
        self._copy_in(piece)  # its gradient sums the heads' parts
        return piece


def apply_plan(gm: fx.GraphModule, walk: Walk) -> ShardingResult:
    """Rewrite ``gm`` as ``walk`` (:func:`~.planner.plan_graph` on its graph) planned it."""
    Applier(gm.graph, walk.env, walk.group, walk.rank, walk.p).run(walk.plan)
    if walk.region_out:
        drop_unused_bodies(gm)  # the bodies as traced, replaced by their rewrites
    gm.graph.lint()
    gm.recompile()
    walk.result.outputs = walk.outputs
    return walk.result
