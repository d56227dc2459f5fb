"""The boost pass pipeline, in the order the backend runs it.

Each pass is one module here; its docstring states the invariant it keeps.
A pass is switched off with ``torch.compile(m, backend="boost",
options={"<name>": False})``.
"""

from __future__ import annotations

from .base import BoostPass, PassContext
from .btp import BottleneckTP
from .checkpoint import Checkpoint
from .detect_bottlenecks import DetectBottlenecks
from .functionalize import Functionalize
from .group_linears import GroupLinears
from .inline_regions import InlineRegions
from .online_norm import OnlineNorm

PIPELINE: tuple[type[BoostPass], ...] = (
    InlineRegions,
    Functionalize,
    DetectBottlenecks,
    BottleneckTP,
    GroupLinears,
    OnlineNorm,
    Checkpoint,
)
# Run before any analysis: what detection and the sharding rules may assume of a graph.
FRONT: tuple[type[BoostPass], ...] = (InlineRegions, Functionalize)
# What parallelize() runs on its captured graphs to build the plan (detection aside).
TP_PASSES: tuple[type[BoostPass], ...] = (BottleneckTP, GroupLinears, OnlineNorm)

__all__ = [
    "PIPELINE",
    "TP_PASSES",
    "BoostPass",
    "BottleneckTP",
    "Checkpoint",
    "DetectBottlenecks",
    "FRONT",
    "Functionalize",
    "GroupLinears",
    "InlineRegions",
    "OnlineNorm",
    "PassContext",
]
