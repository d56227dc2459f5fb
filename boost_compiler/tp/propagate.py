"""Sharding propagation: decide every value's placement and rewrite to local shapes.

One forward walk over a dynamo graph (global shapes, fake tensors). Each node
gets a :class:`~boost_compiler.tp.placement.Placement`; a node's rule may convert
its inputs first (all-gather a shard, all-reduce a partial, slice a
replicated value) and rewrites size arguments from global to local. Five
conversions are enough, and each has the backward that keeps gradients exact
(``collectives.py``):

    P -> R   reduce_from_tp  (g)      S -> R   gather_from_tp
    R -> S   scatter_to_tp            P -> S   reduce_scatter_to_tp
    R into a rank-varying op: copy_to_tp (f)

The last one is what makes every gradient exact without case analysis: a
replicated value that requires grad and feeds a computation whose result
differs per rank receives only a partial gradient on each rank, so ``f`` sums
it in the backward. Graph outputs are always made replicated, so what leaves a
graph (and crosses a graph break) is the global tensor.

The per-op rules live in :mod:`~boost_compiler.tp.rules` (one module per op
family, looked up by op kind in :mod:`~boost_compiler.tp.rules.registry`);
this module holds the walk, the parameter decisions and the conversions the
rules call.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck
from ..errors import MutationError, ShardingError
from ..ir.ops import shape_of, value_of, weight_step
from ..ir.writes import is_mutation
from . import collectives as C
from .collectives import Collective as Collective  # re-exported: the plan's records
from .placement import P, Placement, R, S, unblock
from .rules.core import describe as _describe
from .rules.core import requires_grad as _requires_grad
from .rules.registry import ShardingResult, reads_blocks, rule_for

log = get_logger(__name__)


class ShardingPropagator:
    """Rewrites ``gm`` in place for one rank of a ``p``-way tensor-parallel group.

    ``fixed`` holds parameter placements decided earlier (the model's shards
    already exist); parameters not in it are decided here, and the decisions
    are returned in :attr:`result.params`.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        param_names: dict[str, str],
        bottlenecks: list[Bottleneck],
        p: int,
        group: str,
        rank: int,
        fixed: dict[str, Placement] | None = None,
        vocab_parallel: bool = True,
    ) -> None:
        self.gm, self.graph = gm, gm.graph
        self.param_names, self.p, self.group = param_names, p, group
        # The rank is written into rank-dependent nodes (gather/scatter slice by
        # it) so the graph text, hence the AOTAutograd cache key, differs per rank.
        self.rank = rank
        self.fixed = dict(fixed or {})
        # False: LM heads are not split on the vocabulary (option btp="replicated_head").
        self.vocab_parallel = vocab_parallel
        self.role: dict[str, str] = {}
        for b in bottlenecks:
            self.role[b.down_node] = "down"
            self.role[b.up_node] = "up"
        self.env: dict[fx.Node, Placement] = {}
        self.undecided: set[fx.Node] = set()
        self.converted: dict[tuple[fx.Node, Placement], fx.Node] = {}
        self.result = ShardingResult()

    # -- entry -------------------------------------------------------------

    def run(self) -> ShardingResult:
        for node in list(self.graph.nodes):
            if node._erased:  # folded into a later node by a rule (a written-out norm)
                continue
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "output":
                self._output(node)
            elif node.op in ("call_function", "call_method"):
                self._call(node)
            else:
                self.env[node] = R
        for node in list(self.undecided):  # parameters only ever used replicated
            self._decide(node, R)
        for node, pl in self.env.items():  # for drawings and dumps (boost explain)
            node.meta["boost_placement"] = pl
        self.graph.lint()
        self.gm.recompile()
        return self.result

    # -- placeholders and params -------------------------------------------

    def _placeholder(self, node: fx.Node) -> None:
        fqn = self.param_names.get(node.name)
        if fqn is None:
            self.env[node] = R
        elif fqn in self.fixed:
            self.env[node] = self.fixed[fqn]
            self.result.params[fqn] = self.fixed[fqn]
        else:
            self.undecided.add(node)

    def _decide(self, node: fx.Node, placement: Placement) -> Placement:
        """Fix an undecided parameter's placement on its first use."""
        if node not in self.undecided:
            return self.env[node]
        fqn = self.param_names[node.name]
        if placement.is_shard:
            size = shape_of(node)[placement.dim]
            if size % self.p:
                raise ShardingError(
                    f"parameter {fqn!r}: dimension {placement.dim} of size {size} is not "
                    f"divisible by the tensor-parallel degree p={self.p}"
                )
        self.undecided.discard(node)
        self.env[node] = placement
        self.result.params[fqn] = placement
        if placement.is_shard:
            self._regather_early_readers(node, placement)
        return placement

    def _regather_early_readers(self, param: fx.Node, placement: Placement) -> None:
        """Nodes walked before ``param`` was split read it whole: give them the gathered weight.

        A rule may leave a parameter undecided (an element-wise op on it with nothing
        sharded, e.g. ``w.abs().mean()`` as a scale) until a later node splits it; at
        run time that early reader would compute on the shard while its placement
        says replicated (a silently wrong scale, or a shape error). Casts and 2-D
        transposes of the weight on the way to the splitting node carry the shard
        (their placement is corrected); any other walked reader gets an all-gather.
        """
        stack = [(param, placement)]
        while stack:
            node, pl = stack.pop()
            for user in list(node.users):
                if user not in self.env:
                    continue  # not walked yet (or the node deciding now): it sees the shard
                step = weight_step(user) if user.args and user.args[0] is node else None
                if step is not None and len(shape_of(user) or ()) == len(shape_of(node) or ()):
                    flipped = pl if step == "same" else S(1 - pl.dim, pl.blocks)
                    self.env[user] = flipped
                    stack.append((user, flipped))
                    continue
                gathered = self.to_replicate(
                    node, user, reason=f"{user.name} reads the weight whole"
                )
                user.replace_input_with(node, gathered)

    def peek(self, arg: Any) -> Placement | None:
        """The placement so far; None for a parameter not yet decided."""
        if isinstance(arg, fx.Node):
            return None if arg in self.undecided else self.env.get(arg, R)
        return R

    def placement(self, arg: Any) -> Placement:
        if isinstance(arg, fx.Node):
            if arg in self.undecided:
                return self._decide(arg, R)
            return self.env.get(arg, R)
        return R

    # -- conversions -------------------------------------------------------

    def to_replicate(self, arg: Any, user: fx.Node, reason: str = "") -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        pl = self.placement(arg)
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

    def to_shard(self, arg: Any, dim: int, user: fx.Node) -> Any:
        pl = self.placement(arg)
        if pl == S(dim):
            return arg
        if pl == P:  # partial sums to shards: one reduce-scatter, not all-reduce + slice
            key = (arg, S(dim))
            if key not in self.converted:
                with self.graph.inserting_after(arg):
                    new = self.graph.call_function(
                        C.reduce_scatter_to_tp, (arg, dim, self.group, self.rank, self.p)
                    )
                new.meta["example_value"] = value_of(arg)
                self.env[new] = S(dim)
                self.converted[key] = new
            return self.converted[key]
        if pl != R:
            arg = self.to_replicate(arg, user, "reshard")
        key = (arg, S(dim))
        if key not in self.converted:
            with self.graph.inserting_after(arg):
                new = self.graph.call_function(
                    C.scatter_to_tp, (arg, dim, self.group, self.rank, self.p)
                )
            self.env[new] = S(dim)
            self.converted[key] = new
        return self.converted[key]

    def _copy_in(self, node: fx.Node) -> None:
        """f on every replicated input that requires grad of a rank-varying node."""
        for arg in node.all_input_nodes:
            if self.env.get(arg, R) == R and _requires_grad(arg) and arg not in self.undecided:
                key = (arg, Placement("F"))
                if key not in self.converted:
                    with self.graph.inserting_after(arg):
                        new = self.graph.call_function(C.copy_to_tp, (arg, self.group))
                    self.env[new] = R
                    self.converted[key] = new
                node.replace_input_with(arg, self.converted[key])

    def set(self, node: fx.Node, placement: Placement) -> None:
        self.env[node] = placement
        if placement != R:
            self._copy_in(node)

    # -- rules -------------------------------------------------------------

    def _call(self, node: fx.Node) -> None:
        if not reads_blocks(node) and any(
            (pl := self.peek(a)) is not None and pl.blocks and a.name not in self.param_names
            for a in node.all_input_nodes
        ):
            return self._fallback(node)  # only a split into its blocks reads a blocked shard
        rule = rule_for(self, node)
        if rule is not None:
            rule(self, node)
            return
        ins = [self.placement(a) for a in node.all_input_nodes]
        if any(pl != R for pl in ins):
            self._fallback(node)
        else:
            self.env[node] = R

    def _fallback(self, node: fx.Node) -> None:
        if is_mutation(node):  # gathering a copy and writing into it would lose the write
            raise MutationError(
                f"{_describe(node)}: an in-place op reached sharding propagation; the "
                "'functionalize' pass must run first (this is a boost-compiler bug)"
            )
        msg = f"{_describe(node)}: no sharding rule, gathering its inputs (exact, slower)"
        log.warning("btp: %s", msg)
        self.result.fallbacks.append(msg)
        self._replicate_inputs(node)
        self.env[node] = R

    def _replicate_inputs(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            new = self.to_replicate(arg, node)
            if new is not arg:
                node.replace_input_with(arg, new)

    def _output(self, node: fx.Node) -> None:
        self._replicate_inputs(node)
