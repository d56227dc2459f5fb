"""The tensor-parallel plan: each parameter's placement, each collective's payload.

Invariant: ``collectives`` is what :func:`~boost_compiler.tp.collectives.graph_collectives`
reads off the captured graphs after the pipeline, graph after graph, in node order;
nothing else writes it, so it lists what those graphs do and nothing they no longer do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

from ..analysis.bottlenecks import Bottleneck
from .collectives import Collective
from .placement import Placement


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

    def __rich__(self) -> Group:
        return Group(self.param_table(), self.collective_table())
