"""What a run writes besides checkpoints: the metrics JSON lines, TensorBoard scalars, the
loss-curve PNG, the bar.

Apart from the loop (``train.loop``) so that the loop reads as the training algorithm;
:func:`read_metrics` is also the reader for whoever looks at a run afterwards. Metrics are
strict JSON (:func:`json_safe`: a non-finite value is written as ``null``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .._logging import get_logger
from ..errors import TrainConfigError
from .config import TrainConfig

log = get_logger(__name__)


class Metrics:
    """JSON lines on rank 0: appended on resume (the curve continues), fresh otherwise.

    ``tensorboard`` (``--tensorboard``) receives every record as well, so a scalar
    written to the JSON lines (eval records included) reaches TensorBoard by one path.
    """

    def __init__(
        self, path: str | None, append: bool, enabled: bool,
        tensorboard: TensorBoard | None = None,
    ) -> None:  # fmt: skip
        self.path = Path(path) if path and enabled else None
        self.tensorboard = tensorboard if enabled else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            # Python's json writes NaN / Infinity, which no strict JSON reader accepts.
            line = json.dumps(json_safe(record), allow_nan=False)
            with open(self.path, "a") as f:
                f.write(line + "\n")
        if self.tensorboard is not None:
            self.tensorboard.add(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


TENSORBOARD_EXTRA = "pip install 'boost-compiler[tensorboard]'"
# Metrics record key -> TensorBoard tag, for step records and for "eval" records.
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu"}  # fmt: skip
EVAL_SCALARS = {"eval_loss": "eval/loss", "eval_ppl": "eval/ppl"}


def run_folder(cfg: TrainConfig) -> Path | None:
    """The run's own folder: ``--checkpoint-dir``, else the ``--metrics`` file's folder."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    if cfg.metrics:
        return Path(cfg.metrics).parent
    return None


class TensorBoard:
    """Scalars of the metrics records as TensorBoard event files in ``log_dir``.

    The writer is made at the first record, not here: that record's step (the start
    record's: 0, or the resumed step) becomes ``purge_step``, so TensorBoard hides the
    events an earlier process logged in the folder from that step on: after a crash and
    ``--resume`` those past the checkpoint (as the JSON lines' reader keeps a step's last
    record), and on a fresh run all of them (as the JSON lines file starts empty).
    """

    def __init__(self, log_dir: Path, writer_class: Any) -> None:
        self.log_dir = log_dir
        self._writer_class = writer_class
        self._writer: Any = None

    def add(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        if self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.log_dir), purge_step=step)
        event = record.get("event")
        tags = EVAL_SCALARS if event == "eval" else STEP_SCALARS if event is None else {}
        wrote = False
        for key, tag in tags.items():
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)
                wrote = True
        if wrote:  # a crash loses no logged step (the writer buffers for 2 minutes by default)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def open_tensorboard(cfg: TrainConfig, enabled: bool) -> TensorBoard | None:
    """``--tensorboard``'s writer under ``<run folder>/tensorboard`` (rank 0), else None.

    Checked on every rank, so that a missing package or run folder stops all of them
    before any work, not rank 0 alone while the others wait in a collective.
    """
    if not cfg.tensorboard:
        return None
    folder = run_folder(cfg)
    if folder is None:
        raise TrainConfigError(
            "--tensorboard writes under the run folder: give --checkpoint-dir DIR "
            "(or --metrics FILE, whose folder is then the run folder)"
        )
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise TrainConfigError(
            f"--tensorboard needs the tensorboard package: {TENSORBOARD_EXTRA} "
            f"(or pip install tensorboard) ({err})"
        ) from err
    return TensorBoard(folder / "tensorboard", SummaryWriter) if enabled else None


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON ``null``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def read_metrics(path: str | Path) -> dict[int, dict[str, Any]]:
    """Step records of a metrics file; a step logged twice (a crash after it) keeps the last.

    A non-finite step (``{"event": "nonfinite", "loss": null}``) is not a point of the curve.
    """
    out: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "event" not in rec:
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


def step_description(loss: float, tokens_per_s: float, mfu: float | None) -> str:
    """The bar's text for a step: loss, tokens/s and MFU ("n/a" without a peak FLOP/s)."""
    share = "n/a" if mfu is None else f"{mfu:.1%}"
    return f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | MFU {share}"


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
