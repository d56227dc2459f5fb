"""The one order of the passes, and the two subsets the others rely on.

Invariant: :data:`PIPELINE` is the only place the passes' order is written; the driver
(:mod:`.driver`) runs it, :mod:`boost_compiler.options` reads the pass names from it.
This module imports the passes and nothing that imports it back.
"""

from __future__ import annotations

from .activation_checkpoint import Checkpoint
from .base import BoostPass
from .btp import BottleneckTP
from .detect_bottlenecks import DetectBottlenecks
from .functionalize import Functionalize
from .group_linears import GroupLinears
from .inline_regions import InlineRegions
from .online_norm import OnlineNorm
from .reduce_scatter_grads import ReduceScatterGrads

PIPELINE: tuple[type[BoostPass], ...] = (
    InlineRegions,
    Functionalize,
    DetectBottlenecks,
    BottleneckTP,
    GroupLinears,
    OnlineNorm,
    ReduceScatterGrads,
    Checkpoint,
)
# Run before any analysis: what detection and the sharding rules may assume of a graph.
FRONT: tuple[type[BoostPass], ...] = (InlineRegions, Functionalize)
# What a parallelized model cannot do without: the rewrite to shards and what it assumes.
TP_REQUIRED: tuple[str, ...] = ("inline_regions", "functionalize", "detect_bottlenecks", "btp")
