"""The tensor-parallel plan: each parameter's placement, each collective's payload."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

from .detect import Bottleneck
from .placement import Placement
from .sharding import Collective


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
        t = Table(title="collectives per step (captured example)", title_justify="left")
        for col in ("node", "kind", "payload (global)", "bytes", "fwd", "bwd", "why"):
            t.add_column(col)
        for c in self.collectives:
            if not (c.forward or c.backward):
                continue
            numel = 1
            for s in c.global_shape:
                numel *= int(s)
            t.add_row(
                c.node,
                c.kind,
                str(list(c.global_shape)),
                f"{numel * c.dtype.itemsize:,}",
                "✓" if c.forward else "",
                "✓" if c.backward else "",
                c.reason,
            )
        return t

    def __rich__(self) -> Group:
        return Group(self.param_table(), self.collective_table())
