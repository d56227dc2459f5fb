"""The tiny in-process training run the checkpoint and run-folder tests share.

Four eager steps of the ``tiny`` preset, a checkpoint every two (``step_2``, ``step_4``),
metrics and the loss curve in the run folder: seconds on CPU, every file a run writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from boost_compiler.train import TrainConfig, train

QUICK = dict(batch=2, seq=16, warmup=1, compile=False, progress=False, log_every=1)


def tiny_config(root: Path, **kw: Any) -> TrainConfig:
    """The run's config under ``root`` (``ckpt/``, ``metrics.jsonl``, ``loss.png``), ``kw`` on top."""
    base = dict(steps=4, save_every=2, checkpoint_dir=str(root / "ckpt"),
                metrics=str(root / "metrics.jsonl"), plot=str(root / "loss.png"), **QUICK)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def trained_run(root: Path, **kw: Any) -> Path:
    """``root`` after the run: its two checkpoints are there."""
    train(tiny_config(root, **kw))
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step_2", "step_4"]
    return root
