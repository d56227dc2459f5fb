"""The one place that chooses a device and a process-group backend.

Every other module of the trainer, the benchmarks and the tensor-parallel code takes
its device from here (or from the tensors it is given), so the same code runs on an
accelerator and on the CPU: ``tests/test_device_agnostic.py`` walks their source and
refuses a literal ``"cpu"`` device or ``"gloo"`` backend anywhere else. The questions
asked of a live group's backend are answered here too (:func:`group_backend`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["group_backend", "pick_device", "process_group_backend"]


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


def group_backend(pg: Any, device: torch.device | str) -> str | None:
    """The backend (``"nccl"``, ``"gloo"``, ``"fake"``...) that moves ``device``'s
    tensors on process group ``pg``; ``None`` where none does.

    Why not ``dist.get_backend(pg)``: for a group made with a per-device string, such as
    :func:`process_group_backend`'s ``"cuda:nccl,cpu:gloo"``, it returns that whole
    string, which equals no backend's name. The group's backend config maps every device
    type to its backend, plain ``"gloo"`` included (``"cpu:gloo,cuda:gloo"``).
    """
    import torch.distributed as dist

    kind = torch.device(device).type
    served: dict[str, str] = {}
    for part in dist.get_backend_config(pg).split(","):
        dev, sep, name = part.strip().rpartition(":")
        served[dev if sep else "*"] = name.lower()
    return served.get(kind, served.get("*"))
