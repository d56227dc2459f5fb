"""The tensor-parallel plan: each parameter's placement, each collective's payload.

Invariants: ``collectives`` is what :func:`~boost_compiler.tp.collectives.graph_collectives`
reads off the captured graphs after the pipeline, graph after graph, in node order;
nothing else writes it, so it lists what those graphs do and nothing they no longer do.
``graphs`` holds one :class:`GraphRecord` for every graph the pipeline rewrote for this
model, at ``parallelize`` and at every later compile (another shape, eval mode, the
user's ``torch.compile``), written only by :meth:`TPPlan.record_graph`; ``fallbacks`` is
every distinct gather those graphs fell back to, each naming the first graph it came from.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from ..analysis.bottlenecks import Bottleneck
from ..errors import PlanFileError
from .collectives import Collective
from .placement import Placement
from .rules.registry import ShardingResult
from .strategy import Choice

# The saved plan's format (TPPlan.save/load, boost explain's plan.json); a new version
# when a field changes meaning.
PLAN_FORMAT, PLAN_VERSION = "boost-plan", 1


@dataclass(frozen=True)
class RankMemory:
    """Bytes each rank holds for the model's parameters, their gradients and AdamW's state."""

    params: int
    grads: int  # one per trainable parameter element
    adamw: int  # exp_avg + exp_avg_sq
    replicated: dict[str, int]  # parameter -> elements, held whole on every rank

    @property
    def total(self) -> int:
        return self.params + self.grads + self.adamw


def input_shapes(inputs: Sequence[Any]) -> tuple[str, ...]:
    """The shapes of a graph's tensor inputs that are not parameters (``"2x16"``...)."""
    return tuple(
        "x".join(map(str, t.shape)) for t in inputs
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
    )  # fmt: skip


@dataclass(frozen=True)
class GraphRecord:
    """One graph the pipeline rewrote for the model: where it came from, what it gathered."""

    index: int
    origin: str  # "parallelize" (its capture), "compile" (a graph compiled later), "explain"
    inputs: tuple[str, ...]  # the shapes of its non-parameter tensor inputs, e.g. "2x16"
    fallbacks: tuple[str, ...]
    collectives: int
    # The planner's prediction of what the graph sends per call (logical bytes, forward
    # plus backward, as benchmarks/ count gloo's events), before the optimising passes.
    predicted_bytes: float = 0.0

    def __str__(self) -> str:
        return f"graph {self.index} ({self.origin}, inputs {', '.join(self.inputs) or 'none'})"


@dataclass
class TPPlan:
    """What ``parallelize`` decided, printable with ``rich.print(plan)``."""

    p: int
    group: str
    params: dict[str, Placement] = field(default_factory=dict)
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    bottlenecks: list[Bottleneck] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)  # e.g. how the LM head is split, and why
    choices: list[Choice] = field(default_factory=list)  # every alternative weighed, with costs
    param_itemsize: dict[str, int] = field(default_factory=dict)
    trainable: set[str] = field(default_factory=set)
    graphs: list[GraphRecord] = field(default_factory=list)
    # The file (or "a TPPlan") whose placements parallelize(..., plan=) forced; None: decided.
    forced_from: str | None = None
    # How parallelize compiles the model: "per-block (N blocks)", each repeated block one
    # nested compile region, or "whole model: <why not per block>"; "" where no
    # parallelize decided it (boost explain plans the model as one graph).
    route: str = ""

    def record_graph(
        self, origin: str, inputs: tuple[str, ...], fallbacks: list[str], collectives: int,
        predicted_bytes: float = 0.0,
    ) -> GraphRecord:  # fmt: skip
        """Add a rewritten graph; its fallbacks join ``fallbacks`` once each, with the graph."""
        record = GraphRecord(
            len(self.graphs), origin, inputs, tuple(fallbacks), collectives, predicted_bytes
        )
        self.graphs.append(record)
        known = {f.split(" [from graph ")[0] for f in self.fallbacks}
        for msg in dict.fromkeys(fallbacks):
            if msg not in known:
                self.fallbacks.append(f"{msg} [from {record}]")
        return record

    def to_json(self, model_name: str = "") -> dict[str, Any]:
        """The plan as JSON-ready data: placements, shapes, bottlenecks, collectives, graphs."""
        params = {
            name: {"placement": str(pl), "shape": list(self.param_shapes.get(name, ())),
                   "itemsize": self.param_itemsize.get(name, 4),
                   "trainable": name in self.trainable}
            for name, pl in self.params.items()
        }  # fmt: skip
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "model": model_name, "p": self.p,
            "forced_from": self.forced_from, "route": self.route, "params": params,
            "bottlenecks": [asdict(b) for b in self.bottlenecks],
            "collectives": [_collective_json(c) for c in self.collectives],
            "graphs": [asdict(g) for g in self.graphs],
            "fallbacks": list(self.fallbacks), "decisions": list(self.decisions),
            "choices": [asdict(c) for c in self.choices],
        }  # fmt: skip

    @staticmethod
    def from_json(data: Mapping[str, Any], source: str = "the plan") -> TPPlan:
        """The plan :meth:`to_json` wrote; :class:`PlanFileError` naming what is malformed."""
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            raise PlanFileError(f'{source}: not a boost plan (no "format": "{PLAN_FORMAT}")')
        if data.get("version") != PLAN_VERSION:
            raise PlanFileError(f"{source}: plan format version {data.get('version')!r}; "
                                f"this build reads {PLAN_VERSION}")  # fmt: skip
        try:
            route = str(data.get("route") or "")  # files saved before it have none
            plan = TPPlan(p=int(data["p"]), group="", forced_from=data.get("forced_from"),
                          route=route)  # fmt: skip
            for name, entry in data["params"].items():
                plan.params[name] = Placement.parse(entry["placement"], f"{source}: {name!r}")
                plan.param_shapes[name] = tuple(int(s) for s in entry["shape"])
                plan.param_itemsize[name] = int(entry.get("itemsize", 4))
                if entry.get("trainable", True):
                    plan.trainable.add(name)
            plan.bottlenecks = [_dataclass(Bottleneck, b) for b in data.get("bottlenecks", [])]
            plan.collectives = [_collective(c) for c in data.get("collectives", [])]
            plan.graphs = [_dataclass(GraphRecord, g) for g in data.get("graphs", [])]
            plan.fallbacks = list(data.get("fallbacks", []))
            plan.decisions = list(data.get("decisions", []))
            plan.choices = [Choice(**c) for c in data.get("choices", [])]
        except PlanFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            # OverflowError: int(float("inf")), a size no plan can have
            raise PlanFileError(f"{source}: malformed plan ({type(err).__name__}: {err})") from err
        return plan

    def save(self, path: str | Path, model_name: str = "") -> Path:
        """Write the plan as JSON; ``parallelize(model, mesh, inputs, plan=path)`` forces it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(model_name), indent=1) + "\n")
        return path

    @staticmethod
    def load(path: str | Path) -> TPPlan:
        """A plan saved by :meth:`save` or by ``boost explain`` (its ``plan.json``)."""
        path = Path(path)

        def no_constant(name: str) -> Any:
            # Python's JSON reader accepts Infinity / NaN, which no size or degree can be
            raise PlanFileError(f"{path}: {name} is not a number a plan holds (a degree, a "
                                "shape, a byte count are finite integers)")  # fmt: skip

        try:
            data = json.loads(path.read_text(), parse_constant=no_constant)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PlanFileError(
                f"{path}: cannot read a plan ({type(err).__name__}: {err})"
            ) from err
        except RecursionError:  # the reader recurses once per nesting level
            raise PlanFileError(
                f"{path}: nested deeper than Python's JSON reader follows (a saved plan is a "
                "few levels deep): not a plan boost wrote"
            ) from None
        plan = TPPlan.from_json(data, str(path))
        plan.forced_from = str(path)
        return plan

    def add_graph(
        self, origin: str, inputs: tuple[str, ...], result: ShardingResult | None,
        bottlenecks: Sequence[Bottleneck], collectives: Sequence[Collective],
    ) -> GraphRecord:  # fmt: skip
        """Fold one rewritten graph of the captured example into the plan (parallelize, explain).

        ``result`` is the btp pass's :class:`~.rules.registry.ShardingResult` (None when the
        pass did not run): its parameter placements, fallbacks and decisions.
        """
        empty = ShardingResult()
        result = result or empty
        bottlenecks = [*bottlenecks, *result.bottlenecks]  # with those inside region bodies
        self.params.update(result.params)
        seen = {(b.down, b.up) for b in self.bottlenecks}
        self.bottlenecks += [b for b in bottlenecks if (b.down, b.up) not in seen]
        self.collectives += collectives
        self.choices += result.choices
        decisions = [*result.decisions, *grouped_choices(result.choices)]
        self.decisions += [d for d in decisions if d not in self.decisions]
        return self.record_graph(origin, inputs, list(result.fallbacks), len(collectives),
                                 predicted_bytes(result))  # fmt: skip

    def rank_memory(self) -> RankMemory:
        """Per-rank parameter, gradient and AdamW bytes of this plan (a shard is 1/p)."""
        params = grads = 0
        replicated: dict[str, int] = {}
        for name, pl in self.params.items():
            numel = math.prod(self.param_shapes.get(name, ()))
            local = numel // self.p if pl.is_shard else numel
            if not pl.is_shard:
                replicated[name] = numel
            nbytes = local * self.param_itemsize.get(name, 4)
            params += nbytes
            grads += nbytes if name in self.trainable else 0
        return RankMemory(params, grads, 2 * grads, replicated)

    def forward_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.forward]

    def backward_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.backward]

    def param_table(self) -> Table:
        t = Table(title=f"parameters (tp={self.p})", title_justify="left")
        for col in ("parameter", "global shape", "placement", "per-rank shape"):
            t.add_column(col)
        for name, pl in self.params.items():
            shape = self.param_shapes.get(name, ())
            local = list(shape)
            if pl.is_shard and local:
                local[pl.dim] //= self.p
            t.add_row(name, str(tuple(shape)), str(pl), str(tuple(local)))
        return t

    def collective_table(self) -> Table:
        """Collectives per step grouped by kind, payload and direction, with counts."""
        t = Table(title="collectives per step (captured example)", title_justify="left")
        for col in ("kind", "payload (global)", "count", "bytes each", "fwd", "bwd", "why"):
            t.add_column(col)
        groups: dict[tuple, list[Collective]] = {}
        for c in self.collectives:
            if c.forward or c.backward:
                key = (c.kind, tuple(c.global_shape), c.dtype, c.forward, c.backward, c.reason)
                groups.setdefault(key, []).append(c)
        for (kind, shape, _, fwd, bwd, why), found in groups.items():
            t.add_row(
                kind, str(list(shape)), str(len(found)), f"{found[0].nbytes:,}",
                "✓" if fwd else "", "✓" if bwd else "", why,
            )  # fmt: skip
        return t

    def memory_text(self) -> str:
        m = self.rank_memory()
        held = ", ".join(f"{k} ({v:,})" for k, v in m.replicated.items()) or "none"
        return (
            f"per rank: parameters {m.params:,} B, gradients {m.grads:,} B, AdamW state "
            f"{m.adamw:,} B; held whole on every rank (elements): {held}"
        )

    def __rich__(self) -> Group:
        route = [f"compiled: {self.route}"] if self.route else []
        return Group(*route, self.param_table(), self.memory_text(), self.collective_table())


def _collective_json(c: Collective) -> dict[str, Any]:
    shape = [_size_json(s) for s in c.global_shape]
    return {**asdict(c), "global_shape": shape, "dtype": str(c.dtype).removeprefix("torch.")}


def _size_json(size: Any) -> int | str:
    """A size as an int: a symbolic one (a dynamic-shape graph's) at its example value."""
    try:
        return int(size)
    except (TypeError, ValueError):
        return str(size)


def _collective(data: Mapping[str, Any]) -> Collective:
    dtype = getattr(torch, str(data["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise PlanFileError(f"collective {data.get('node')!r}: unknown dtype {data['dtype']!r}")
    return Collective(
        data["kind"], data["node"], tuple(data["global_shape"]), dtype,
        bool(data["forward"]), bool(data["backward"]), data.get("reason", ""),
    )  # fmt: skip


def predicted_bytes(result: ShardingResult) -> float:
    """The planner's prediction for one graph: logical bytes per call, forward + backward."""
    return sum(c.logical for c in result.predicted.values())


def grouped_choices(choices: Sequence[Choice]) -> list[str]:
    """One line per kind of choice: repeated layers (their indices as ``*``) counted once."""
    groups: dict[tuple[str, str], list[Choice]] = {}
    for c in choices:
        where = re.sub(r"\.\d+\.", ".*.", re.sub(r"\(node \w+, ", "(", c.where))
        groups.setdefault((where, c.chosen), []).append(c)
    lines = []
    for (where, chosen), found in groups.items():
        c = found[0]
        alts = "; ".join(f"{label}: {c.seconds[label] * 1e6:.1f} us, {c.wire[label]:.0f} B"
                         for label in c.seconds)  # fmt: skip
        times = f" (x{len(found)})" if len(found) > 1 else ""
        lines.append(f"{where}: {chosen}{times}, weighed against the alternatives [{alts}]")
    return lines


def _dataclass(cls: type, data: Mapping[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known})
