"""Global gradient-norm clipping over a (dp, tp) layout, every parameter counted once.

Why not ``torch.nn.utils.clip_grad_norm_``: on a rank it sees only local
tensors. After ``parallelize`` a TP-sharded parameter's gradient is split over
the tp ranks (its squares must be summed over tp), while a TP-replicated one
(e.g. the LM head) holds the same full gradient on every tp rank (summing over
tp would count it tp times). Under FSDP2 every gradient is further split over the
dp ranks (sum over dp); with plain gradient all-reduce it is identical across dp
(do not sum). Getting one of these wrong changes the norm by a factor of
``sqrt(tp)`` or ``sqrt(dp)`` for part of the model: training still runs, which
is why it is a known silent bug. Here each case is explicit:

    total^2 = sum_dp? ( sum_tp( sum S-sharded g^2 ) + sum replicated g^2 )

The result equals ``clip_grad_norm_`` on the single-device model (tested), and
the same clip coefficient ``max_norm / (total + 1e-6)``, clamped to 1, is applied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class GradSlot:
    """One parameter and whether its gradient is split over the tensor-parallel group."""

    param: nn.Parameter
    tp_sharded: bool


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own data of a tensor or DTensor (FSDP2 parameters and gradients)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def global_grad_norm(
    slots: Iterable[GradSlot],
    *,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32 scalar), the same on every rank.

    ``tp_group``: sum the sharded parameters' squares over it (None: tp = 1).
    ``dp_group``: sum everything over it; pass it only when gradients are sharded
    over dp (FSDP2), not when they are all-reduced (replicated).
    """
    grads: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for slot in slots:
        if slot.param.grad is not None:
            grads[slot.tp_sharded].append(local_tensor(slot.param.grad))
    device = next((g[0].device for g in grads.values() if g), None)
    with torch.no_grad():
        sq_sharded, sq_replicated = (_sum_of_squares(grads[k], device) for k in (True, False))
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sq_sharded, group=tp_group)
    total = sq_sharded + sq_replicated
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    return total.sqrt()


def clip_grad_norm_(
    slots: Iterable[GradSlot],
    max_norm: float,
    *,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale every gradient in place so the global norm is at most ``max_norm``.

    Returns the norm before clipping (like torch's). ``max_norm <= 0`` only measures.
    """
    slots = list(slots)
    total = global_grad_norm(slots, tp_group=tp_group, dp_group=dp_group)
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for grads in _by_device(slots).values():
                torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """sum g^2 over ``grads`` in fp32, a fixed number of kernels however many there are
    (one per parameter each was a launch and, with small gradients, most of the time)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = []
    for group in _group_by_device(grads).values():
        norms.extend(torch._foreach_norm(group, 2.0, dtype=torch.float32))
    return torch.stack([n.to(device) for n in norms]).pow(2).sum()


def _group_by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _by_device(slots: list[GradSlot]) -> dict[torch.device, list[torch.Tensor]]:
    grads = [local_tensor(s.param.grad) for s in slots if s.param.grad is not None]
    return _group_by_device(grads)
