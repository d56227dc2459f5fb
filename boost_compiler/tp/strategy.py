"""What a sharding rule returns: a strategy for one node, as data (the rule API).

Invariant: a :class:`Strategy` describes, and never performs, how one node runs on a
rank: the placement each input is read as (the applier inserts the conversion), the
open parameters it fixes, the call it becomes (target and arguments, which name the
node's original inputs), the placement of its value, and, for a partial result, the
conversion after it. A rule builds one from its node and :class:`RuleContext`, a
read-only view of the placements decided so far, so the planner can ask a rule for
its strategies as often as it likes, compare alternatives by their :class:`Cost`, and
hand the chosen ones to the one applier (``tp/apply.py``). A fallback is a strategy
too: every input read whole, with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.fx as fx

from .placement import Placement, R


@dataclass(frozen=True)
class Read:
    """How a node reads one input: as ``placement``, converted if it is held otherwise.

    ``expand``: a replicated broadcast is read as its local piece, ``base.expand(*sizes)``
    made on each rank (no communication forward; ``f`` on ``base`` sums its gradient).
    ``via``: read the conversion to ``placement`` of this other node, which holds the same
    values (a copy already gathered for another reader).
    """

    placement: Placement
    reason: str = ""
    expand: tuple[fx.Node, tuple[Any, ...]] | None = None
    via: fx.Node | None = None


@dataclass(frozen=True)
class Call:
    """The node's call after the rewrite; ``args`` name the node's original inputs."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    op: str = "call_function"


@dataclass(frozen=True)
class Then:
    """The conversion right after a partial (``P``) node, before any op reads it.

    ``to``: ``R`` (all-reduce) or ``S(d)`` (reduce-scatter); ``bias`` is added once to
    the converted sum (a row-parallel layer's bias), read at that placement. A partial
    without one stays pending: its readers keep it (``rules/partial.py``, ops linear in
    it) or read it converted.
    """

    to: Placement
    reason: str
    bias: fx.Node | None = None


@dataclass(frozen=True)
class Fuse:
    """Several nodes replaced by the strategy's call (a written-out norm made one node).

    The new node is inserted before ``end`` and takes its uses; ``chain`` (walked or not)
    is erased, and so is each of ``dead`` that no one reads afterwards.
    """

    end: fx.Node
    chain: tuple[fx.Node, ...]
    dead: tuple[fx.Node, ...] = ()


@dataclass
class Cost:
    """Predicted cost of a strategy on one rank: bytes on the wire and replicated work.

    ``wire``: bytes a rank sends for the collectives its conversions add, forward plus
    backward (ring algorithms: an all-reduce of ``N`` bytes sends ``2(p-1)/p N``);
    ``logical``: the same collectives' sizes as nccl-tests count them (an all-reduce's
    input, an all-gather's result, a reduce-scatter's input), what ``benchmarks/``
    measure from gloo's events; ``collectives``: how many (each pays the latency);
    ``replicated_flops``: work every rank repeats that one rank's share would do;
    ``held``: parameter bytes every rank keeps whole that a split would leave with the
    others (``(p-1)/p`` of each weight the strategy fixes replicated, and of its gradient).

    Why memory is priced in seconds: the planner compares alternatives by one number, and
    a weight kept whole costs each rank its bytes for the whole run (a frozen LoRA base
    is most of a rank's memory). A byte held is priced as one byte sent per step, so a
    weight stays whole only where splitting it would send more per step than the part
    of it a rank would no longer hold.
    """

    wire: float = 0.0
    collectives: int = 0
    replicated_flops: float = 0.0
    logical: float = 0.0
    held: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.wire + other.wire,
            self.collectives + other.collectives,
            self.replicated_flops + other.replicated_flops,
            self.logical + other.logical,
            self.held + other.held,
        )

    def seconds(self, model: CostModel) -> float:
        return (
            self.collectives * model.latency
            + (self.wire + self.held) / model.bandwidth
            + self.replicated_flops / model.flops
        )


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta communication and compute speeds the planner weighs costs with.

    Defaults: a CPU process group (gloo) and one core; :meth:`for_device` picks an
    accelerator's rough figures (NVLink-class bandwidth, ~10 us per collective).
    """

    latency: float = 30e-6  # s per collective
    bandwidth: float = 2e9  # B/s a rank sends
    flops: float = 5e10  # FLOP/s of one rank

    @staticmethod
    def for_device(device: str) -> CostModel:
        if device == "cuda":
            return CostModel(latency=10e-6, bandwidth=4.5e11, flops=1e15)
        return CostModel()


@dataclass(frozen=True)
class Choice:
    """One choice of the planner: the alternatives it weighed and their predicted costs.

    ``seconds``: label -> predicted time on this rank (alpha-beta communication plus the
    work done whole, plus the parameter bytes it holds whole priced as ``Cost.held`` says),
    the alternative's own cost plus its readers' cheapest response;
    ``wire``: label -> bytes a rank sends for it, forward plus backward.
    """

    where: str
    chosen: str
    seconds: dict[str, float]
    wire: dict[str, float]

    def __str__(self) -> str:
        alts = "; ".join(
            f"{label} {self.seconds[label] * 1e6:.1f} us, {self.wire[label]:.0f} B"
            for label in self.seconds
        )
        return f"{self.where}: {self.chosen} ({alts})"


@dataclass
class Strategy:
    """How one node runs on a rank; see the module docstring."""

    out: Placement = R
    reads: dict[fx.Node, Read] = field(default_factory=dict)
    fix: dict[fx.Node, Placement] = field(default_factory=dict)
    call: Call | None = None
    then: Then | None = None
    fuse: Fuse | None = None
    fallback: str = ""  # the reason a sharded evaluation was refused; inputs read whole
    whole: bool = False  # every input not in ``reads`` is read whole (R)
    copy_in: bool | None = None  # f on replicated inputs needing grad (default: out is not R)
    keep_open: bool = False  # reads open parameters whole without fixing them (see planner)
    note: str = ""  # a decision worth recording in the plan, with its reason
    cost: Cost = field(default_factory=Cost)
    label: str = ""  # names this alternative in plan.decisions
    body: Any = None  # a region call's plan (``tp/regions.py``): the body it runs instead

    def read(self, arg: Any, placement: Placement, reason: str = "") -> Strategy:
        if isinstance(arg, fx.Node):
            self.reads[arg] = Read(placement, reason)
        return self

    @property
    def rank_varying(self) -> bool:
        return self.copy_in if self.copy_in is not None else self.out != R


NO_RULE = "no sharding rule, gathering its inputs (exact, slower)"


def fallback(reason: str = NO_RULE) -> Strategy:
    """Every input read whole and the op run on full values: exact, and listed in the plan."""
    return Strategy(out=R, fallback=reason, whole=True)


def replicated() -> Strategy:
    """The op on full values: every input read whole (a partial one is summed first)."""
    return Strategy(out=R, whole=True)


class RuleContext(Protocol):
    """What a rule may read while it decides: placements so far, and the group's facts."""

    p: int  # the tensor-parallel degree
    rank: int
    group: str  # the process group's name (written into the collectives)
    vocab_parallel: bool  # LM heads may be split on the vocabulary
    expert_parallel: bool  # MoE experts go on ranks wherever they can (rules/expert_parallel)

    def placement(self, arg: Any) -> Placement:
        """The input's placement; an open parameter reads as ``R`` (what it is, whole)."""
        ...

    def peek(self, arg: Any) -> Placement | None:
        """As :meth:`placement`, but None for a parameter whose placement is still open."""
        ...

    def is_open(self, arg: Any) -> bool: ...
    def is_param(self, arg: Any) -> bool: ...
    def param_name(self, arg: fx.Node) -> str: ...
    def param_names(self) -> set[str]: ...
    def role(self, node: fx.Node) -> str | None:
        """``"down"`` or ``"up"`` for a bottleneck's factor contraction, else None."""
        ...

    def gathered(self, arg: fx.Node) -> fx.Node | None:
        """A node planned to be gathered whole that holds ``arg``'s values, if any."""
        ...
