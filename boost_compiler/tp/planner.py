"""The planner: every node's strategy for one graph, decided before anything is rewritten.

Invariant: planning reads the graph and changes nothing. One forward walk asks each
node's rule (``tp/rules/``) for its strategy given the placements decided so far,
and a parameter's placement is fixed by the first node that reads it (a bottleneck's
factor by its role, an embedding by its lookup; read whole, it is replicated), except
that a node may read a parameter whole and leave it open (``w.abs()`` before the layer
that splits ``w``). When such a parameter was split later, a second walk plans every
node again with all parameters fixed, so that early reader is planned for the shard,
not patched afterwards; the second walk is exactly what a graph compiled later (or a
forced plan) gets, since its parameters are fixed from the start.
A nested compile region's call is one node whose body is planned once per layout of its
operands (``tp/regions.py``). The strategies go to the one applier (``tp/apply.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck
from ..errors import BoostError, MutationError, ShardingError
from ..ir.ops import shape_of, value_of
from ..ir.subgraphs import is_call
from ..ir.writes import is_mutation
from . import plan_cost as cost
from .copy_site import copy_site
from .placement import P, Placement, R
from .regions import (
    RegionPlanner,
    call_strategy,
    output_strategy,
    reads_region,
    region_output_strategy,
)
from .rules.core import describe, requires_grad
from .rules.registry import ShardingResult, reads_blocks, rule_for
from .strategy import Choice, Cost, CostModel, Strategy, fallback, replicated

_F = Placement("F")  # the key of an f (copy_to_tp) among the planned conversions

log = get_logger(__name__)


@dataclass(frozen=True)
class PlanRequest:
    """What one rank's plan of one graph is asked: the planning inputs, in one place.

    ``param_names`` maps placeholder names to parameter FQNs; ``bottlenecks`` give the
    factors their roles; the plan is for ``rank`` of the ``p``-way group named ``group``.
    ``fixed`` holds parameter placements decided earlier (the model's shards exist); the
    others are decided by the plan (``result.params``). ``vocab_parallel`` splits LM heads
    on the vocabulary (option ``btp``'s ``"replicated_head"`` turns it off);
    ``expert_parallel`` puts MoE experts on ranks wherever it can (its ``"expert_parallel"``).
    ``inputs``: the graph is a region's body, its non-parameter inputs so placed; ``regions`` plans the
    region calls it makes (without one, a call reads its operands whole: exact, listed as
    a fallback).
    """

    param_names: dict[str, str]
    bottlenecks: tuple[Bottleneck, ...]
    p: int
    group: str
    rank: int
    fixed: dict[str, Placement] = field(default_factory=dict)
    vocab_parallel: bool = True
    expert_parallel: bool = False
    inputs: dict[str, Placement] | None = None
    regions: RegionPlanner | None = None

    def roles(self) -> dict[str, str]:
        """Each bottleneck factor's node name -> ``"down"`` or ``"up"``."""
        role: dict[str, str] = {}
        for b in self.bottlenecks:
            role[b.down_node] = "down"
            role[b.up_node] = "up"
        return role


class Walk:
    """One planning walk over ``graph``: the rules' :class:`RuleContext` and its record."""

    def __init__(self, graph: fx.Graph, request: PlanRequest, cost_model: CostModel) -> None:
        self.graph, self.request = graph, request
        self._param_names, self._role = request.param_names, request.roles()
        self.p, self.group, self.rank = request.p, request.group, request.rank
        self.vocab_parallel = request.vocab_parallel
        self.expert_parallel = request.expert_parallel
        self.fixed = dict(request.fixed)
        self.cost_model = cost_model
        # A region's body: its inputs' placements (by placeholder name); its outputs keep
        # theirs (``outputs``). None for a graph whose inputs and outputs are global.
        self.inputs, self.regions = request.inputs, request.regions
        self.outputs: tuple[Placement, ...] = ()
        self.region_out: dict[fx.Node, tuple[Placement, ...]] = {}
        self.env: dict[fx.Node, Placement] = {}
        self.open: set[fx.Node] = set()
        self.plan: dict[fx.Node, Strategy] = {}
        self.absorbed: set[fx.Node] = set()
        # Conversions the plan makes, in the order made (a dict: the same order on every rank,
        # where a set of nodes would iterate by their ids).
        self.planned: dict[tuple[fx.Node, Placement], None] = {}
        self.result = ShardingResult()
        # Open parameters a node read whole while leaving them open (``keep_open``): if one
        # is split later, that node was planned for the whole value and is planned again.
        self.read_open: set[fx.Node] = set()

    # -- the RuleContext -----------------------------------------------------

    def placement(self, arg: Any) -> Placement:
        if isinstance(arg, fx.Node) and arg not in self.open:
            return self.env.get(arg, R)
        return R

    def peek(self, arg: Any) -> Placement | None:
        if isinstance(arg, fx.Node):
            return None if arg in self.open else self.env.get(arg, R)
        return R

    def is_open(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg in self.open

    def is_param(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg.name in self._param_names

    def param_name(self, arg: fx.Node) -> str:
        return self._param_names[arg.name]

    def param_names(self) -> set[str]:
        return set(self._param_names)

    def role(self, node: fx.Node) -> str | None:
        return self._role.get(node.name)

    def gathered(self, arg: fx.Node) -> fx.Node | None:
        from .rules.slicing import same_values

        root, shape, dtype = same_values(arg)
        return next(
            (
                c
                for c, to in self.planned
                if to == R and (same := same_values(c))[0] is root and same[1:] == (shape, dtype)
            ),
            None,
        )

    # -- the walk ------------------------------------------------------------

    def run(self) -> None:
        for node in self.graph.nodes:
            if node in self.absorbed:
                continue
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "output":
                s, self.outputs = output_strategy(self, node)
                self._commit(node, s)
                del self.env[node]
            elif self.regions is not None and is_call(node):
                self._commit(node, call_strategy(self, node, self.regions))
            elif reads_region(node, self.region_out):
                self._commit(node, region_output_strategy(node, self.region_out))
            elif node.op in ("call_function", "call_method"):
                self._commit(node, self._strategy(node))
            else:
                self.env[node] = R
        for node in [n for n in self.graph.nodes if n in self.open]:  # only ever read whole
            self._decide(node, R)

    def _placeholder(self, node: fx.Node) -> None:
        fqn = self._param_names.get(node.name)
        if fqn is None:
            self.env[node] = (self.inputs or {}).get(node.name, R)
        elif fqn in self.fixed:
            self.env[node] = self.fixed[fqn]
            self.result.params[fqn] = self.fixed[fqn]
        else:
            self.open.add(node)

    def _options(self, node: fx.Node) -> list[Strategy]:
        """The strategies the node's rule allows (one, or alternatives to weigh)."""
        if self.regions is not None and is_call(node):
            return [Strategy(out=R, copy_in=False)]  # reads its operands as they are
        if not reads_blocks(node) and any(
            (pl := self.peek(a)) is not None and pl.blocks and not self.is_param(a)
            for a in node.all_input_nodes
        ):
            return [fallback()]  # only a split into its blocks reads a blocked shard
        rule = rule_for(self, node)
        if rule is not None:
            found = rule(self, node)
            return list(found) if isinstance(found, (list, tuple)) else [found]
        if any(self.placement(a) != R for a in node.all_input_nodes):
            return [fallback()]
        return [replicated()]

    def _strategy(self, node: fx.Node) -> Strategy:
        options = self._options(node)
        return options[0] if len(options) == 1 else self._choose(node, options)

    # -- costs ---------------------------------------------------------------

    def _choose(self, node: fx.Node, options: list[Strategy]) -> Strategy:
        """The cheapest alternative: its own cost plus its readers' best response to it."""
        scored = []
        for s in options:
            cost = self.cost_of(node, s) + self._readers_cost(node, s)
            scored.append((cost.seconds(self.cost_model), cost, s))
        best = min(scored, key=lambda t: t[0])
        self.result.choices.append(Choice(
            where=describe(node), chosen=best[2].label,
            seconds={s.label: t for t, _, s in scored}, wire={s.label: c.wire for _, c, s in scored},
        ))  # fmt: skip
        return best[2]

    def cost_of(self, node: fx.Node, s: Strategy) -> Cost:
        """What ``s`` adds on this rank (``tp/plan_cost.py``): conversions, f, its own call,
        and the open parameters it fixes replicated (each held whole on every rank)."""
        inputs = _inputs(node, s)
        parts = [s.cost, *(self._read_cost(node, s, a) for a in inputs)]
        if not s.keep_open:
            parts += [cost.held(value_of(a), self.p) for a in inputs
                      if self.is_open(a) and not s.fix.get(a, R).is_shard]  # fmt: skip
        if s.then is not None:
            parts.append(cost.conversion(value_of(node), P, s.then.to, self.p))
        if s.out == R and s.fuse is None:
            parts.append(cost.replicated_work(node, self.p))
        return cost.total(parts)

    def _read_cost(self, node: fx.Node, s: Strategy, arg: fx.Node) -> Cost:
        read = s.reads.get(arg)
        if read is not None and read.expand is not None:
            return cost.copy_in(value_of(read.expand[0]), self.p)
        if read is not None and read.via is not None:
            return Cost()
        # An open parameter is read as the strategy fixes it (whole, unless it says).
        cur = s.fix.get(arg, self.placement(arg)) if self.is_open(arg) else self.placement(arg)
        want = read.placement if read is not None else (R if s.whole else cur)
        found = Cost()
        if want != cur and (arg, want) not in self.planned:
            found = cost.conversion(value_of(arg), cur, want, self.p)
        if s.rank_varying and want == R:
            found = found + self._copy_cost(node, arg, cur)
        return found

    def _copy_cost(self, node: fx.Node, arg: fx.Node, cur: Placement) -> Cost:
        """``f`` on ``arg`` for ``node``, or on the smaller value it is gathered from."""
        _, src = copy_site(arg, node, self._read_as)
        if (src, _F) in self.planned:
            return Cost()
        # f after a gather sends its gradient back as one reduce-scatter (the pass
        # ``reduce_scatter_grads``): half an all-reduce.
        return cost.copy_in(value_of(src), self.p, gathered=src is arg and cur.is_shard)

    def _read_as(self, node: fx.Node, src: fx.Node) -> Placement:
        """The placement the planned ``node`` reads its input ``src`` as."""
        s = self.plan.get(node)
        read = s.reads.get(src) if s is not None else None
        if read is not None:
            return read.placement
        return R if s is not None and s.whole else self.placement(src)

    def _readers_cost(self, node: fx.Node, s: Strategy) -> Cost:
        """What reading ``node``'s value costs its readers at their cheapest, given ``s``."""
        if s.fuse is not None:  # the chain is replaced: its end's readers read the call
            node = s.fuse.end
        before = self.env.get(node)
        self.env[node] = s.then.to if s.then is not None else s.out
        try:
            parts = []
            for user in node.users:
                if user.op == "output":
                    parts.append(cost.conversion(value_of(node), self.env[node], R, self.p))
                    continue
                try:
                    options = self._options(user)
                except BoostError:
                    continue  # refused whatever the placement: no preference
                parts.append(min(
                    (self._read_cost(user, o, node) for o in options),
                    key=lambda c: c.seconds(self.cost_model),
                ))  # fmt: skip
            return cost.total(parts)
        finally:
            if before is None:
                del self.env[node]
            else:
                self.env[node] = before

    def _decide(self, node: fx.Node, placement: Placement) -> None:
        if node not in self.open:
            return
        fqn = self._param_names[node.name]
        if placement.is_shard:
            size = shape_of(node)[placement.dim]
            if size % self.p:
                raise ShardingError(
                    f"parameter {fqn!r}: dimension {placement.dim} of size {size} is not "
                    f"divisible by the tensor-parallel degree p={self.p}"
                )
        self.open.discard(node)
        self.env[node] = placement
        self.result.params[fqn] = placement
        self.fixed[fqn] = placement

    @property
    def stale(self) -> bool:
        """Whether a node was planned for a parameter read whole that was split afterwards."""
        return any(self.env.get(prm, R) != R for prm in self.read_open)

    def _commit(self, node: fx.Node, s: Strategy) -> None:
        if s.fallback:
            if is_mutation(node):  # gathering a copy and writing into it would lose the write
                raise MutationError(
                    f"{describe(node)}: an in-place op reached the sharding planner; the "
                    "'functionalize' pass must run first (this is a boost-compiler bug)"
                )
            msg = f"{describe(node)}: {s.fallback}"
            log.warning("btp: %s", msg)
            self.result.fallbacks.append(msg)
        for param, pl in s.fix.items():
            self._decide(param, pl)
        # What the applier will insert for it (conversions it shares are counted once).
        self.result.predicted[node.name] = self.cost_of(node, s)
        inputs = _inputs(node, s)
        if s.keep_open:
            self.read_open.update(a for a in inputs if a in self.open)
        else:
            for arg in inputs:
                self._decide(arg, R)  # an open parameter read whole is replicated
        for arg in inputs:
            read = s.reads.get(arg)
            want = read.placement if read is not None else (R if s.whole else None)
            cur = self.placement(arg)
            if want is not None and want != cur:
                if want.is_shard and cur.is_shard:
                    self.planned[(arg, R)] = None  # another split: through the whole value
                self.planned[(read.via if read and read.via else arg, want)] = None
            if s.rank_varying and (want or cur) == R and requires_grad(arg):
                self.planned[(copy_site(arg, node, self._read_as)[1], _F)] = None
        if s.note:
            self.result.decisions.append(s.note)
        if s.fuse is not None:
            self.absorbed.update(s.fuse.chain)
            self.env[s.fuse.end] = s.out
        self.plan[node] = s
        self.env[node] = s.then.to if s.then is not None else s.out
        if s.then is not None:
            self.planned[(node, s.then.to)] = None


def _inputs(node: fx.Node, s: Strategy) -> list[fx.Node]:
    """The nodes ``node`` reads once rewritten (its new call's, and a bias added after it)."""
    if s.call is None:
        found = list(node.all_input_nodes)
    else:
        found = []
        fx.node.map_arg((s.call.args, s.call.kwargs), found.append)
    if s.then is not None and s.then.bias is not None:
        found.append(s.then.bias)
    return list(dict.fromkeys(found))


def _device(graph: fx.Graph) -> str:
    """The device type the graph's values live on (its first tensor's)."""
    for node in graph.nodes:
        v = value_of(node)
        if isinstance(v, torch.Tensor):
            return v.device.type
    return torch.get_default_device().type


def plan_graph(graph: fx.Graph, request: PlanRequest) -> Walk:
    """Every node's strategy for one rank (``request``); the graph is not changed."""
    model = CostModel.for_device(_device(graph))
    first = Walk(graph, request, model)
    first.run()
    if not first.stale:
        return first
    # Every parameter is fixed now: plan again, so that early readers see the shards.
    second = Walk(graph, dataclasses.replace(request, fixed=first.fixed), model)
    second.run()
    second.result.decisions = first.result.decisions
    second.result.params = {k: first.result.params[k] for k in first.result.params}
    return second
