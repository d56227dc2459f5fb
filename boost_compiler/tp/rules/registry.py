"""The sharding-rule registry: op kind -> the rule that places a node of that kind.

A rule is a pure function ``(ctx, node) -> Strategy`` (``tp/strategy.py``) registered
with :func:`rule` for one or more op kinds of :mod:`~boost_compiler.ir.op_table`: it
reads the node and the placements in ``ctx`` and returns what it allows, and never
changes a graph (``tests/test_rule_purity.py`` walks these modules' code). Invariant:
the planner reaches rules only through :func:`rule_for`, which applies the one
default every rule shares before dispatch: a node none of whose inputs is sharded is
replicated without calling its rule (a partial input is all-reduced, an open
parameter it reads is fixed replicated). A rule therefore runs only when some input
is a shard, unless it registered with ``always=True`` (rules that decide parameter
placements, or leave them open, on replicated inputs). A node with a partial (``P``)
input goes to its kind's :func:`partial_rule` first, if it has one (ops linear in a
partial sum keep it pending, ``partial.py``). A node whose kind has no rule
falls back in the planner: its inputs are gathered, which is exact, and the plan
lists it. Nothing here knows any op; the family modules
(``pointwise``, ``matrix``, ``views``, ``slicing``, ``reductions``, ``vocab``,
``experts``, ``partial``)
register themselves when :mod:`boost_compiler.tp.rules` is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ...ir.op_table import op_kind, spellings_scope
from ..placement import P, Placement
from ..strategy import Choice, Cost, RuleContext, Strategy
from ..strategy import replicated as _replicated


@dataclass
class ShardingResult:
    """What the rules decided for one graph (the collectives are read off the graph)."""

    params: dict[str, Placement] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)  # choices made, with their reason
    choices: list[Choice] = field(default_factory=list)  # alternatives weighed, with costs
    predicted: dict[str, Cost] = field(default_factory=dict)  # node -> what it will send
    # Region bodies (``tp/regions.py``): a body's output placements; the bodies an outer
    # graph's calls run (identifiers), and the bottlenecks found inside, per call.
    outputs: tuple[Placement, ...] = ()
    regions: list[str] = field(default_factory=list)
    bottlenecks: list[Any] = field(default_factory=list)


# One strategy, or alternatives for the planner to weigh by their cost.
RuleFn = Callable[[RuleContext, fx.Node], Strategy | list[Strategy]]
Guard = Callable[[RuleContext, fx.Node], bool]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    guard: Guard | None = None  # the rule applies only where this holds
    always: bool = False  # also called when no input is sharded


# kind -> rules, the latest registration first (a later rule overrides an earlier one).
_RULES: dict[str, list[Rule]] = {}
# kind -> the rule for a node of that kind with a partial input (the latest registration).
_PARTIAL: dict[str, RuleFn] = {}
# Kinds that may read a blocked shard (each reads whole blocks); any other op gathers it.
_BLOCK_READERS: set[str] = set()
# Kinds the op table knows that deliberately have no rule (sharded input: gathered).
_DETECTION_ONLY = "element-wise, read by bottleneck detection; pointwise.ELEMENTWISE would take it"
UNSUPPORTED: dict[str, str] = {
    "elu": _DETECTION_ONLY,
    "mish": _DETECTION_ONLY,
    "hardswish": _DETECTION_ONLY,
}


def rule(
    *kinds: str, guard: Guard | None = None, always: bool = False, reads_blocks: bool = False
) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated ``(ctx, node) -> Strategy`` as the rule for ``kinds``.

    ``guard``: the rule applies only to nodes for which ``guard(ctx, node)``
    holds (guarded rules are tried before unguarded ones of the same kind).
    ``always``: call the rule even when no input is sharded, for rules that
    decide parameters or act on replicated inputs. ``reads_blocks``: the op
    reads a blocked shard (a fused q/k/v output) block by block; without it such
    an input is gathered first.
    """

    def register(fn: RuleFn) -> RuleFn:
        for kind in kinds:
            _RULES.setdefault(kind, []).insert(0, Rule(fn, guard, always))
            if reads_blocks:
                _BLOCK_READERS.add(kind)
        return fn

    return register


def partial_rule(*kinds: str) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated ``(ctx, node) -> Strategy`` for nodes of ``kinds`` that read
    a partial (``P``) value; it is called before any :func:`rule` of the kind."""

    def register(fn: RuleFn) -> RuleFn:
        _PARTIAL.update(dict.fromkeys(kinds, fn))
        return fn

    return register


def registered_kinds() -> set[str]:
    return {kind for kind, rules in _RULES.items() if rules}


def reads_blocks(node: fx.Node) -> bool:
    return op_kind(node) in _BLOCK_READERS


def replicated(ctx: RuleContext, node: fx.Node) -> Strategy:
    """The shared default: no input sharded, so the op runs on full values.

    Reading a parameter whole fixes it replicated; a partial input is summed
    first (defensive: a row-parallel output is reduced before any op reads it).
    """
    return _replicated()


def rule_for(ctx: RuleContext, node: fx.Node) -> RuleFn | None:
    """The rule to call for ``node``: :func:`replicated` when no input is sharded; None without one."""
    kind = op_kind(node) or ""
    if kind in _PARTIAL and any(ctx.peek(a) == P for a in node.all_input_nodes):
        return _PARTIAL[kind]
    rules = _RULES.get(kind, ())
    found = next((r for r in rules if r.guard is not None and r.guard(ctx, node)), None)
    found = found or next((r for r in rules if r.guard is None), None)
    if found is None:
        return None
    if not found.always and not any(
        (pl := ctx.peek(a)) is not None and pl.is_shard for a in node.all_input_nodes
    ):
        return replicated
    return found.fn


@contextmanager
def scope() -> Iterator[None]:
    """Undo, on exit, every rule and op-table spelling registered inside (tests)."""
    rules = {kind: list(found) for kind, found in _RULES.items()}
    partial = dict(_PARTIAL)
    readers = set(_BLOCK_READERS)
    with spellings_scope():
        try:
            yield
        finally:
            _RULES.clear()
            _RULES.update(rules)
            _PARTIAL.clear()
            _PARTIAL.update(partial)
            _BLOCK_READERS.clear()
            _BLOCK_READERS.update(readers)
