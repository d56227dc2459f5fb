"""Tensor parallelism across nested compile regions: each block planned once per layout.

A region call (:mod:`boost_compiler.ir.subgraphs`) passes its body a block's activations
and parameters. Invariant: every call runs a body rewritten for exactly the placements
its operands have at that call (its *key*: each activation's placement, each parameter's
fixed placement or "open"), so each call computes its rank's part of the single-device
result. Calls with one key share one rewritten body, which torch traces and lowers once;
a call with another key gets its own copy under a new identifier, since torch caches a
body's compilation by identifier and two rewrites must never share one. The parameters a
body decides are fixed alike at every call that shares it, under each call's own names.
A body's outputs keep the placements the body gives them (a partial one is summed inside
it) and the region's readers read them so. Planning a body runs the whole pass pipeline
on a copy of it (``plan_body``, given by the btp pass); the outer graph is not changed
here: the applier installs the bodies (``tp/apply.py``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.fx as fx

from ..analysis.bottlenecks import Bottleneck
from ..ir.subgraphs import body_of, drop_dead_size_queries, graph_copy, operands
from .placement import P, Placement, R
from .rules.registry import ShardingResult
from .strategy import Strategy, replicated

OPEN = "open"  # a parameter operand whose placement the body decides


@dataclass
class BodyPlan:
    """What planning a body for one key gave: the body to install, and what it decided."""

    body: fx.GraphModule  # the copy, rewritten for this rank
    identifier: str  # torch's cache key for it: unique per rewritten body
    attr: str  # the outer module's attribute that will hold it
    outputs: tuple[Placement, ...]
    names: dict[int, str]  # operand position -> the parameter it was planned as
    result: ShardingResult
    bottlenecks: list[Bottleneck] = field(default_factory=list)


@dataclass
class CallPlan:
    """One call's plan: its body, and the parameters it fixes (operand position -> placement)."""

    body: BodyPlan
    fix: dict[int, Placement]
    rename: dict[str, str]  # the body's parameter names -> this call's


class Placements(Protocol):
    """What the region planner reads of the outer walk (the planner's ``Walk``)."""

    def placement(self, arg: Any) -> Placement: ...
    def is_open(self, arg: Any) -> bool: ...
    def is_param(self, arg: Any) -> bool: ...
    def param_name(self, arg: fx.Node) -> str: ...


class RegionWalk(Placements, Protocol):
    """The outer walk where it plans a call: its record, and its calls' output placements."""

    inputs: dict[str, Placement] | None  # set when the walked graph is itself a body
    result: ShardingResult
    region_out: dict[fx.Node, tuple[Placement, ...]]


# (copy of the body, its parameter names, its input placements, fixed parameter placements)
# -> the btp result and the bottlenecks found; the copy is rewritten in place.
BodyPlanner = Callable[
    [fx.GraphModule, dict[str, str], dict[str, Placement], dict[str, Placement]],
    tuple[ShardingResult, list[Bottleneck]],
]


class RegionPlanner:
    """Plans region calls for one outer graph, each distinct (body, key) once."""

    def __init__(self, plan_body: BodyPlanner) -> None:
        self._plan_body = plan_body
        self._plans: dict[tuple[str, tuple[Any, ...]], BodyPlan] = {}
        self._per_body: dict[str, int] = {}

    def plan(self, walk: Placements, call: fx.Node) -> CallPlan:
        args = operands(call)
        key = tuple(self._key_of(walk, a) for a in args)
        attr = call.args[0].target
        found = self._plans.get((attr, key))
        if found is None:
            found = self._plans[(attr, key)] = self._plan_new(walk, call, key)
        rename = {
            found.names[i]: walk.param_name(a) for i, a in enumerate(args) if i in found.names
        }
        fix = {i: found.result.params[found.names[i]] for i, k in enumerate(key) if k == OPEN}
        return CallPlan(found, fix, rename)

    @staticmethod
    def _key_of(walk: Placements, arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return repr(arg)
        if walk.is_param(arg):
            return OPEN if walk.is_open(arg) else ("param", walk.placement(arg))
        pl = walk.placement(arg)
        return R if pl == P else pl  # a partial operand is summed before the call

    def _plan_new(self, walk: Placements, call: fx.Node, key: tuple[Any, ...]) -> BodyPlan:
        original = body_of(call)
        copy = _copy(original)
        holders = [n for n in copy.graph.nodes if n.op == "placeholder"]
        names, inputs, fixed = {}, {}, {}
        for i, (holder, arg) in enumerate(zip(holders, operands(call), strict=True)):
            if isinstance(arg, fx.Node) and walk.is_param(arg):
                names[i] = walk.param_name(arg)
                if key[i] != OPEN:
                    fixed[names[i]] = key[i][1]
            elif isinstance(arg, fx.Node):
                inputs[holder.name] = key[i]
        result, bottlenecks = self._plan_body(
            copy, {holders[i].name: n for i, n in names.items()}, inputs, fixed
        )
        attr, ident = call.args[0].target, call.args[1]
        k = self._per_body.get(attr, 0)
        self._per_body[attr] = k + 1
        if k:  # a second layout of one body: its own attribute and cache identifier
            attr, ident = f"{attr}_boost{k}", f"{ident}_boost{k}"
        return BodyPlan(copy, ident, attr, result.outputs, names, result, bottlenecks)


def call_strategy(walk: RegionWalk, node: fx.Node, regions: RegionPlanner) -> Strategy:
    """A region call runs its body planned for its operands' placements."""
    plan = regions.plan(walk, node)
    args = operands(node)
    s = Strategy(out=R, copy_in=False, body=plan)
    for arg in args:
        if isinstance(arg, fx.Node) and not walk.is_param(arg) and walk.placement(arg) == P:
            s.read(arg, R, "a partial operand of a region is summed before the call")
    s.fix = {args[i]: pl for i, pl in plan.fix.items()}
    walk.region_out[node] = plan.body.outputs
    merge(walk.result, node, plan)
    return s


def reads_region(node: fx.Node, region_out: dict[fx.Node, Any]) -> bool:
    """Whether ``node`` takes one output of a region call (a getitem of it)."""
    return (
        node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and node.args[0] in region_out
    )


def region_output_strategy(node: fx.Node, region_out: dict[fx.Node, Any]) -> Strategy:
    """One output of a region call (a getitem) is placed as the body left it."""
    return Strategy(out=region_out[node.args[0]][node.args[1]], copy_in=False)


def output_strategy(walk: RegionWalk, node: fx.Node) -> tuple[Strategy, tuple[Placement, ...]]:
    """The graph's outputs, and the placements they leave with: read whole, except a
    body's, which keep their placements (a partial one summed)."""
    if walk.inputs is None:
        return replicated(), ()
    outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
    s = Strategy(out=R, copy_in=False)
    for arg in outs:
        if isinstance(arg, fx.Node) and walk.placement(arg) == P:
            s.read(arg, R, "a region's partial output is summed inside it")
    return s, tuple(s.reads[a].placement if a in s.reads else walk.placement(a) for a in outs)


def merge(outer: ShardingResult, call: fx.Node, plan: CallPlan) -> None:
    """Add one call's share of its body's decisions to the outer graph's result.

    Decisions and choices name the module a node was traced in, the first call's
    (``layers.0``): each call's copy names its own, so the plan lists them per layer, as
    the model planned as one graph does.
    """
    inner, where = plan.body.result, f"{call.name} ({plan.body.identifier})"
    here = _at_call(plan.rename)
    outer.fallbacks += [f"{where}: {here(msg)}" for msg in inner.fallbacks]
    outer.predicted.update({f"{call.name}.{k}": c for k, c in inner.predicted.items()})
    outer.bottlenecks += [_renamed(b, plan.rename) for b in plan.body.bottlenecks]
    outer.bottlenecks += [_renamed(b, plan.rename) for b in inner.bottlenecks]
    outer.decisions += [here(d) for d in inner.decisions]
    outer.choices += [dataclasses.replace(c, where=here(c.where)) for c in inner.choices]
    if plan.body.identifier not in outer.regions:
        outer.regions.append(plan.body.identifier)


def _at_call(rename: dict[str, str]) -> Callable[[str], str]:
    """Rewrites a text naming the body's module path (``layers.0.``) with the call's."""
    pairs = {_differing_prefix(a, b) for a, b in rename.items()}
    if len(pairs) != 1 or not (pair := next(iter(pairs)))[0]:
        return lambda text: text  # the first call, or no one module path to swap
    old, new = f"{pair[0]}.", f"{pair[1]}."
    return lambda text: text.replace(old, new)


def _differing_prefix(a: str, b: str) -> tuple[str, str]:
    """``("layers.0", "layers.1")`` for ``layers.0.attn.q.weight``, ``layers.1.attn.q.weight``."""
    pa, pb = a.split("."), b.split(".")
    while pa and pb and pa[-1] == pb[-1]:
        pa, pb = pa[:-1], pb[:-1]
    return ".".join(pa), ".".join(pb)


def _renamed(b: Bottleneck, rename: dict[str, str]) -> Bottleneck:
    fields = ("down", "up", "down_bias", "up_bias")
    return dataclasses.replace(b, **{f: rename.get(getattr(b, f), getattr(b, f)) for f in fields})


def _copy(body: fx.GraphModule) -> fx.GraphModule:
    """A body with its own graph, without the size queries nothing reads."""
    copy = graph_copy(body)
    drop_dead_size_queries(copy.graph)
    copy.recompile()
    return copy
