"""End-to-end training: DP x BTP on a 2-D mesh, DCP checkpoints that reshard, resume.

``boost train`` / ``examples/train.py`` drive :func:`train`; the pieces are usable
alone: :func:`clip_grad_norm_` (global norm over a (dp, tp) layout),
:mod:`~boost_compiler.train.checkpoint` (save / load / export),
:mod:`~boost_compiler.train.stream` (files streamed, tokenized, packed; resumable).
"""

from __future__ import annotations

from ..errors import DataError, VocabSizeError
from .checkpoint import CheckpointError, export, latest
from .clip import GradSlot, clip_grad_norm_, global_grad_norm
from .config import TrainConfig, TrainConfigError
from .loop import TrainResult, lr_at, read_metrics, train

__all__ = [
    "CheckpointError",
    "DataError",
    "GradSlot",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "VocabSizeError",
    "clip_grad_norm_",
    "export",
    "global_grad_norm",
    "latest",
    "lr_at",
    "read_metrics",
    "train",
]
