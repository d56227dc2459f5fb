"""What a run writes besides checkpoints: the metrics JSON lines, the loss-curve PNG, the bar.

Apart from the loop (``train.loop``) so that the loop reads as the training algorithm;
:func:`read_metrics` is also the reader for whoever looks at a run afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._logging import get_logger
from .config import TrainConfig

log = get_logger(__name__)


class Metrics:
    """JSON lines on rank 0: appended on resume (the curve continues), fresh otherwise."""

    def __init__(self, path: str | None, append: bool, enabled: bool) -> None:
        self.path = Path(path) if path and enabled else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> dict[int, dict[str, Any]]:
    """Step records of a metrics file; a step logged twice (a crash after it) keeps the last."""
    out: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[int(rec["step"])] = rec
    return dict(sorted(out.items()))


def plot_losses(losses: dict[int, float], path: Path, title: str) -> Path | None:
    """The loss curve as a PNG (None, with a message, when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss-curve PNG (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(losses), list(losses.values()), lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def progress_bar(enabled: bool, total: int, start: int) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.description}"), TimeElapsedColumn(), TimeRemainingColumn(),
        disable=not enabled,
    )  # fmt: skip
    task = progress.add_task("compiling..." if start == 0 else "resuming...", total=total)
    progress.update(task, completed=start)
    return progress, task


def default_plot(cfg: TrainConfig) -> Path | None:
    """Beside the run's own files; never the working directory (it may hold a loss.png)."""
    if cfg.metrics:
        return Path(cfg.metrics).with_suffix(".png")
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir) / "loss.png"
    return None
