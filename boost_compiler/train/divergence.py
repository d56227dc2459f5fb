"""Divergence: a non-finite step is never taken and a non-finite model never saved.

The loop asks :func:`nonfinite` of each step's (loss, gradient norm), which every rank
computes alike (the norm is global, the loss the dp mean), so every rank decides the
same: stop with :class:`~boost_compiler.errors.DivergenceError` naming the step, or, with
``--on-nonfinite skip``, log it and go on (:func:`on_nonfinite`). Before every save,
:func:`check_finite_parameters` refuses a model a finite gradient overflowed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._logging import get_logger
from ..errors import DivergenceError
from .report import Metrics

log = get_logger(__name__)


def nonfinite(loss: float, norm: float) -> list[str]:
    return [name for name, v in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(v)]


def on_nonfinite(cfg: Any, step: int, lr: float, loss: float, norm: float, bad: list[str],
                 metrics: Metrics, last: Path | None) -> None:  # fmt: skip
    """A non-finite step (no optimizer step was taken): stop by name, or log and go on."""
    metrics.write({"event": "nonfinite", "step": step, "loss": loss, "grad_norm": norm,
                   "nonfinite": bad, "lr": lr, "action": cfg.on_nonfinite})  # fmt: skip
    what = f"non-finite {' and '.join(bad)} (loss {loss}, gradient norm {norm})"
    if cfg.on_nonfinite == "skip":
        log.warning("step %d: %s: optimizer step skipped (--on-nonfinite skip)", step, what)
        return
    raise DivergenceError(
        f"step {step}: {what} at lr {lr:g}: training diverged. The optimizer "
        f"step was not taken and nothing of it saved (last checkpoint: {last or 'none'}). "
        "Lower --lr (or lengthen --warmup, or set --clip), resume from the last checkpoint, "
        "or pass --on-nonfinite skip to skip such steps"
    )


def check_finite_parameters(run: Any, step: int, last: Path | None) -> None:
    """Before a save: never write a non-finite model over the last finite checkpoint.

    ``run`` is the loop's ``_Run`` (its layout and device).

    A finite gradient can still overflow a parameter (a huge lr times weight decay), which
    the loss shows only at the next step. A collective over the world: every rank saves.
    """
    entries = run.layout.entries
    # one host sync in all (the .item() below), not one per parameter: each is a GPU stall
    finite = [torch.isfinite(_local(e.param)).all().to(run.device) for e in entries]
    per_param = torch.stack(finite) if finite else torch.ones(0, dtype=torch.bool)
    flag = per_param.all().float().reshape(1).to(run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1.0:
        bad = [e.name for e, ok in zip(entries, per_param.tolist(), strict=True) if not ok]
        more = " ..." if len(bad) > 5 else ""
        where = f"on this rank: {', '.join(bad[:5])}{more}" if bad else "on another rank"
        raise DivergenceError(
            f"step {step}: the parameters hold NaN/inf ({where}; a finite gradient "
            f"overflowed them): not saved over the last checkpoint ({last or 'none'}). "
            "Lower --lr or --weight-decay, and resume from the last checkpoint"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's piece
