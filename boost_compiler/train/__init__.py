"""End-to-end training: DP x BTP on a 2-D mesh, DCP checkpoints that reshard, resume.

``boost train`` / ``examples/train.py`` drive :func:`train`; the pieces are usable
alone: :func:`clip_grad_norm_` (global norm over a (dp, tp) layout),
:mod:`~boost_compiler.train.checkpoint` (save / load / export),
:mod:`~boost_compiler.train.stream` (files streamed, tokenized, packed; resumable).
What the trainer asks of a model family is a :class:`ModelSpec` (one per kind); a
user's own model (``--model module:function``) is pipelined as a :class:`LayeredLM`.
"""

from __future__ import annotations

from ..errors import DataError, VocabSizeError
from .checkpoint import CheckpointError, export, latest
from .clip import GradSlot, clip_grad_norm_, global_grad_norm
from .config import TrainConfig, TrainConfigError
from .loop import TrainResult, lr_at, read_metrics, train
from .model_spec import ModelSpec
from .spec_module import LayeredLM

__all__ = [
    "CheckpointError",
    "DataError",
    "GradSlot",
    "LayeredLM",
    "ModelSpec",
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
