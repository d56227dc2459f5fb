"""The :class:`Report` of :func:`boost_compiler.explain`: its rows, and its rich rendering."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ..analysis.bottlenecks import Bottleneck
from ..tp.collectives import Collective
from ..tp.placement import Placement, R
from ..tp.plan import TPPlan
from . import draw


@dataclass(frozen=True)
class CollectiveRow:
    """One collective of one stage, with the layer it sits in."""

    stage: str
    layer: str
    collective: Collective

    @property
    def nbytes(self) -> int:
        return draw.collective_bytes(self.collective)


@dataclass
class Stage:
    """The graph after one pass (``input``: before any)."""

    index: int
    name: str
    collectives: list[CollectiveRow] = field(default_factory=list)
    nodes: int = 0
    added: list[str] = field(default_factory=list)  # node names new since the last stage
    removed: list[str] = field(default_factory=list)
    layer_dot: str = ""
    model_dot: str = ""
    files: dict[str, Path] = field(default_factory=dict)  # "layer.svg", "model.dot", ...

    @property
    def slug(self) -> str:
        return f"{self.index:02d}_{self.name}"


@dataclass(frozen=True)
class CostRow:
    name: str
    forward_bytes: int
    backward_bytes: int
    forward_count: int | None
    backward_count: int | None
    note: str = ""

    @property
    def total(self) -> int:
        return self.forward_bytes + self.backward_bytes


@dataclass
class Report:
    """What :func:`explain` found; ``rich.print(report)`` shows it, ``report.html`` holds it all."""

    model_name: str
    tp: int
    bottlenecks: list[Bottleneck]
    plan: TPPlan
    param_dtypes: dict[str, torch.dtype]
    stages: list[Stage]
    layer: str | None
    cost: list[CostRow]
    graphs: int = 1
    out_dir: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)
    dot: bool = False
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    # -- rows shared by the console and the HTML --

    def param_rows(self) -> list[tuple[str, tuple[int, ...], Placement, tuple[int, ...], int, int]]:
        """(name, global shape, placement, per-rank shape, per-rank bytes, global bytes)."""
        rows = []
        for name, shape in self.plan.param_shapes.items():
            pl = self.plan.params.get(name, R)
            local = list(shape)
            if pl.is_shard and local:
                local[pl.dim] //= self.tp
            item = self.param_dtypes[name].itemsize
            rows.append(
                (name, tuple(shape), pl, tuple(local), math.prod(local) * item,
                 math.prod(shape) * item)
            )  # fmt: skip
        return rows

    def collective_groups(self, stage: Stage) -> list[tuple[str, Collective, int]]:
        """(layer, representative collective, count) per layer and distinct collective."""
        groups: dict[tuple, list[Any]] = {}
        for row in stage.collectives:
            c = row.collective
            key = (row.layer, c.kind, tuple(c.global_shape), c.dtype, c.forward, c.backward,
                   c.reason)  # fmt: skip
            groups.setdefault(key, [row.layer, c, 0])[2] += 1
        return [tuple(v) for v in groups.values()]  # type: ignore[misc]

    def final(self) -> Stage | None:
        return self.stages[-1] if self.stages else None

    # -- console --

    def bottleneck_tree(self, collapse_after: int = 4) -> Tree:
        """Bottlenecks by module; more than ``collapse_after`` layers fold into ``layers.*``."""
        tree = Tree(f"[bold]{self.model_name}[/]: {len(self.bottlenecks)} bottleneck(s)")
        fold = len({draw.group_of_path(b.module) for b in self.bottlenecks}) > collapse_after
        leaves: dict[tuple[str, ...], dict[str, list[Bottleneck]]] = {}
        for b in self.bottlenecks:
            parts = b.module.split(".") if b.module else ["·"]
            key = tuple("*" if fold and p.isdigit() else p for p in parts)
            label = (
                f"{b.d_in} → [bold]{b.rank}[/] → {b.d_out}  "
                f"[dim]{' → '.join(b.ops) or 'identity'}[/]  "
                f"[cyan]{b.down.removeprefix(b.module + '.')}[/] → "
                f"[magenta]{b.up.removeprefix(b.module + '.')}[/]"
            )
            leaves.setdefault(key[:-1], {}).setdefault(f"{key[-1]}: {label}", []).append(b)
        branches: dict[tuple[str, ...], Tree] = {(): tree}
        for prefix in sorted(leaves, key=lambda k: [int(p) if p.isdigit() else -1 for p in k]):
            for i in range(1, len(prefix) + 1):
                if prefix[:i] not in branches:
                    branches[prefix[:i]] = branches[prefix[: i - 1]].add(prefix[i - 1])
            for label, members in leaves[prefix].items():
                times = f"  [yellow]×{len(members)}[/]" if len(members) > 1 else ""
                branches[prefix].add(label + times)
        return tree

    def plan_table(self, collapse: bool = True) -> Table:
        """Parameters, placements and per-rank bytes; ``collapse`` folds repeated layers."""
        rows = self.param_rows()
        t = Table(title=f"plan (tp={self.tp}): {len(rows)} parameter(s)", title_justify="left")
        for col in ("parameter", "×", "global shape", "placement", "per-rank shape",
                    "per-rank bytes"):  # fmt: skip
            t.add_column(col, justify="right" if col in ("×", "per-rank bytes") else "left")
        folded: dict[tuple, list[Any]] = {}
        for name, shape, pl, local, nbytes, _ in rows:
            key_name = ".".join("*" if p.isdigit() and collapse else p for p in name.split("."))
            folded.setdefault((key_name, shape, str(pl), local), [nbytes, 0])[1] += 1
        total = 0
        for (name, shape, pl, local), (nbytes, n) in folded.items():
            total += nbytes * n
            t.add_row(name, str(n), str(shape), pl, str(local), f"{nbytes * n:,}")
        t.add_row("[bold]total per rank[/]", "", "", "", "", f"[bold]{total:,}[/]")
        return t

    def collective_table(self) -> Table:
        """Per pass stage and layer: kind, payload, bytes, direction; equal layers folded."""
        t = Table(title="collectives per layer after each pass", title_justify="left")
        for col in ("stage", "layer(s)", "kind", "payload", "bytes", "×", "dir", "why"):
            t.add_column(col, justify="right" if col in ("bytes", "×") else "left")
        for stage in self.stages:
            groups = self.collective_groups(stage)
            if not groups:
                t.add_row(stage.name, "", "[dim]none[/]", "", "", "", "", "")
                continue
            by_layer: dict[str, list[tuple[Collective, int]]] = {}
            for layer, c, n in groups:
                by_layer.setdefault(layer, []).append((c, n))
            runs: list[tuple[list[str], list[tuple[Collective, int]]]] = []
            for layer, items in by_layer.items():
                sig = [(_sig(c), n) for c, n in items]
                if runs and [(_sig(c), n) for c, n in runs[-1][1]] == sig:
                    runs[-1][0].append(layer)
                else:
                    runs.append(([layer], items))
            for i, (layers, items) in enumerate(runs):
                where = (
                    layers[0] if len(layers) == 1 else f"{layers[0]}…{layers[-1]} ×{len(layers)}"
                )
                for j, (c, n) in enumerate(items):
                    t.add_row(
                        stage.name if i == j == 0 else "", where if j == 0 else "", c.kind,
                        draw.payload_text(c), f"{draw.collective_bytes(c):,}", str(n),
                        draw.direction(c), c.reason,
                    )  # fmt: skip
            t.add_section()
        return t

    def cost_table(self) -> Table:
        t = Table(title="communication per step", title_justify="left")
        for col in ("plan", "fwd bytes", "#", "bwd bytes", "#", "total", "vs this plan", "note"):
            t.add_column(col, justify="left" if col in ("plan", "note") else "right")
        ref = next((r.total for r in self.cost if r.name.startswith("this plan")), 0)
        for r in self.cost:
            ratio = f"{r.total / ref:.2f}x" if ref else ""
            t.add_row(
                r.name, f"{r.forward_bytes:,}", _opt(r.forward_count), f"{r.backward_bytes:,}",
                _opt(r.backward_count), f"{r.total:,}", ratio, r.note,
            )  # fmt: skip
        return t

    def __rich__(self) -> Group:
        head = Text.assemble(
            ("boost explain", "bold"),
            f": {self.model_name}, simulated tp={self.tp}, {len(self.bottlenecks)} "
            f"bottleneck(s), stages {' → '.join(s.name for s in self.stages)}, "
            f"drawn layer {self.layer or '—'}, {self.seconds:.1f} s",
        )
        parts: list[Any] = [head, self.bottleneck_tree(), self.plan_table(),
                            self.collective_table(), self.cost_table()]  # fmt: skip
        for err in self.errors:
            parts.append(Text(f"error: {err}", style="bold red"))
        if self.out_dir is not None:
            html = self.files.get("report.html")
            note = "" if self.dot else " (no graphviz `dot`: drawings written as .dot only)"
            parts.append(Text(f"wrote {html or self.out_dir}{note}"))
        return Group(*parts)


def _sig(c: Collective) -> tuple:
    return (c.kind, tuple(c.global_shape), c.dtype, c.forward, c.backward, c.reason)


def _opt(n: int | None) -> str:
    return "" if n is None else str(n)


# -- running the pipeline ---------------------------------------------------------
