"""Which ``torch.distributed.pipelining`` schedule runs the stages, and what each needs.

``1f1b`` and ``gpipe`` run one stage per pp rank; ``interleaved-1f1b`` and ``zero-bubble``
(torch's ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``, ZB1P) run ``v``
virtual stages per rank, placed round-robin as torch's interleaved schedules expect.
Every refusal happens in :func:`check_schedule`, before any stage is built.
"""

from __future__ import annotations

from typing import Any

from ..errors import PipelineError

__all__ = ["MULTI", "SCHEDULES", "check_schedule", "make_schedule"]

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble")
# The schedules that run several (virtual) stages per rank, placed round-robin: stage s on
# pp rank s % pp, so rank r holds stages r, r + pp, ...
MULTI = ("interleaved-1f1b", "zero-bubble")


def make_schedule(stages: list[Any], n_microbatches: int, schedule: str, loss_fn: Any) -> Any:
    """torch's schedule object for this rank's ``stages`` (checked by :func:`check_schedule`)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
             "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}  # fmt: skip
    pp = stages[0].group_size
    if schedule in MULTI:
        return kinds[schedule](stages, n_microbatches, loss_fn=loss_fn)
    if schedule == "1f1b" and n_microbatches < pp:
        raise PipelineError(
            f"1F1B needs n_microbatches >= pp ({n_microbatches} < {pp}); "
            "use more micro-batches or schedule='gpipe'"
        )
    return kinds[schedule](stages[0], n_microbatches, loss_fn=loss_fn)


def check_schedule(
    schedule: str, pp: int, n_microbatches: int, virtual: int, compile: bool
) -> None:
    """Refuse, by name and before anything is built, a schedule this layout cannot run."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule not in MULTI and virtual != 1:
        raise PipelineError(
            f"--schedule {schedule} runs one stage per rank, not {virtual}: "
            f"virtual stages are for {' or '.join(MULTI)}"
        )
    if schedule in MULTI and virtual < 2:
        raise PipelineError(
            f"--schedule {schedule} needs at least 2 stages per rank, got {virtual}"
        )
    if schedule in MULTI and n_microbatches % max(1, n_microbatches // pp):
        raise PipelineError(
            f"--schedule {schedule}: {n_microbatches} micro-batches are not a multiple of its "
            f"rounds (micro-batches // pp = {n_microbatches // pp}); use a multiple of pp={pp}"
        )
    if schedule == "zero-bubble" and compile:
        # Zero bubble splits each backward into the input's and the weights' gradients
        # with autograd on the stage's own graph; a compiled stage is one opaque autograd
        # node (torch refuses compiled stage modules here too, for the same reason).
        raise PipelineError(
            "--schedule zero-bubble splits the backward of eager stages only: "
            "pass --no-compile, or use --schedule interleaved-1f1b with compiled stages"
        )
