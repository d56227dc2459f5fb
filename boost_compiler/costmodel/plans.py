"""Bytes of a built plan and across pipeline stage boundaries, in the cost model's payload
convention (see the package docstring): :func:`plan_comm` reads the collectives
``parallelize`` recorded, so the closed forms of :mod:`.formulas` can be checked against them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .formulas import STAT_BYTES

if TYPE_CHECKING:
    from ..tp.plan import TPPlan


@dataclass(frozen=True)
class PlanComm:
    """Bytes and collectives of a :class:`~boost_compiler.tp.plan.TPPlan`, per step."""

    forward_bytes: int
    backward_bytes: int
    forward_collectives: int
    backward_collectives: int
    rows: tuple[tuple[Any, int], ...]  # (Collective, payload bytes), in plan order


def plan_comm(plan: TPPlan) -> PlanComm:
    """Sum the plan's collectives by direction, with the payload convention above.

    Norm statistics are counted at 4 bytes: ``tp_ops`` reduces them in fp32, while
    the plan records the norm input's dtype (they differ for a bf16 model).
    """
    rows = []
    totals = {"fb": 0, "bb": 0, "fc": 0, "bc": 0}
    for c in plan.collectives:
        item = STAT_BYTES if c.reason == "norm statistics" else c.dtype.itemsize
        nbytes = math.prod(int(x) for x in c.global_shape) * item
        rows.append((c, nbytes))
        for flag, key in ((c.forward, "f"), (c.backward, "b")):
            if flag:
                totals[key + "b"] += nbytes
                totals[key + "c"] += 1
    return PlanComm(totals["fb"], totals["bb"], totals["fc"], totals["bc"], tuple(rows))


@dataclass(frozen=True)
class PipelineBoundary:
    """What one micro-batch moves across one pipeline-stage boundary (bytes, one tp rank).

    ``p2p`` is the activation sent forward (the gradient sent back is as large): the
    hidden shard ``[b/m, s, d/p]``. ``tp_gather`` is what the boundary adds inside the
    tp groups: nothing, since the stages take and return their hidden shard
    (``tp/shard_boundary.py``; before, 4 all-gathers of ``[b/m, s, d]`` per boundary and
    micro-batch, the stage graph's replicated output and the receiver's re-assembly).
    """

    p2p: int
    tp_gather: int


def pipeline_boundary_bytes(
    b: int, s: int, d: int, p: int, m: int, elem_bytes: int = 4
) -> PipelineBoundary:
    """Bytes per micro-batch across a stage boundary of ``b x s`` tokens in ``m`` micro-batches."""
    if b % m or d % p:
        raise ValueError(f"b={b} must divide by m={m} and d={d} by p={p}")
    full = (b // m) * s * d * elem_bytes
    return PipelineBoundary(p2p=full // p, tp_gather=0)
