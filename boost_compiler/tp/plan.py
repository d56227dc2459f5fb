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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from ..analysis.bottlenecks import Bottleneck
from .collectives import Collective
from .placement import Placement


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
    origin: str  # "parallelize" (its capture), or "compile" (a graph dynamo compiled later)
    inputs: tuple[str, ...]  # the shapes of its non-parameter tensor inputs, e.g. "2x16"
    fallbacks: tuple[str, ...]
    collectives: int

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
    param_itemsize: dict[str, int] = field(default_factory=dict)
    trainable: set[str] = field(default_factory=set)
    graphs: list[GraphRecord] = field(default_factory=list)

    def record_graph(
        self, origin: str, inputs: tuple[str, ...], fallbacks: list[str], collectives: int
    ) -> GraphRecord:
        """Add a rewritten graph; its fallbacks join ``fallbacks`` once each, with the graph."""
        record = GraphRecord(len(self.graphs), origin, inputs, tuple(fallbacks), collectives)
        self.graphs.append(record)
        known = {f.split(" [from graph ")[0] for f in self.fallbacks}
        for msg in dict.fromkeys(fallbacks):
            if msg not in known:
                self.fallbacks.append(f"{msg} [from {record}]")
        return record

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
        groups: dict[tuple, int] = {}
        for c in self.collectives:
            if c.forward or c.backward:
                key = (c.kind, tuple(c.global_shape), c.dtype, c.forward, c.backward, c.reason)
                groups[key] = groups.get(key, 0) + 1
        for (kind, shape, dtype, fwd, bwd, why), n in groups.items():
            numel = 1
            for size in shape:
                numel *= int(size)
            t.add_row(
                kind, str(list(shape)), str(n), f"{numel * dtype.itemsize:,}",
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
        return Group(self.param_table(), self.memory_text(), self.collective_table())
