"""User-facing reports as ``rich`` renderables (tables, trees)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from .bottlenecks import Bottleneck


def bottleneck_table(bottlenecks: Sequence[Bottleneck], title: str = "Bottlenecks") -> Table:
    """A table with one row per bottleneck: module, factors, shape, ops between."""
    table = Table(title=f"{title} ({len(bottlenecks)} found)", title_justify="left")
    table.add_column("#", justify="right", style="dim")
    table.add_column("module", no_wrap=True)
    table.add_column("factors (down → up)", overflow="fold")
    table.add_column("d_in → r → d_out", justify="right", no_wrap=True)
    table.add_column("ops between")
    for i, b in enumerate(bottlenecks):
        prefix = b.module + "." if b.module else ""
        table.add_row(
            str(i),
            b.module or "·",
            f"[cyan]{b.down.removeprefix(prefix)}[/] → [magenta]{b.up.removeprefix(prefix)}[/]",
            f"{b.d_in} → [bold]{b.rank}[/] → {b.d_out}"
            + (f" (latent {b.latent})" if b.kind == "latent" else ""),
            " → ".join(b.ops) or "identity",
        )
    return table
