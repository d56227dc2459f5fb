"""The one place that chooses a device and a process-group backend.

Every other module of the trainer, the benchmarks and the tensor-parallel code takes
its device from here (or from the tensors it is given), so the same code runs on an
accelerator and on the CPU: ``tests/test_device_agnostic.py`` walks their source and
refuses a literal ``"cpu"`` device or ``"gloo"`` backend anywhere else.
"""

from __future__ import annotations

import torch

__all__ = ["pick_device", "process_group_backend"]


def pick_device() -> torch.device:
    """This process's accelerator (torchrun set it from ``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_group_backend(device: torch.device | str | None = None) -> str:
    """The c10d backend for ``device`` (default :func:`pick_device`): NCCL for CUDA
    tensors with gloo beside it for CPU ones (object collectives, CPU-side counts),
    gloo alone on a CPU-only machine."""
    kind = torch.device(device).type if device is not None else pick_device().type
    return "cuda:nccl,cpu:gloo" if kind == "cuda" else "gloo"
