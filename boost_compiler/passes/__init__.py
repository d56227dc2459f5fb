"""The boost pass pipeline, in the order every caller runs it.

Invariant: :data:`PIPELINE` is the one order of the passes, and
:func:`~boost_compiler.passes.driver.run_pipeline` the one loop that runs it (the
backend, ``parallelize`` and ``explain`` all call it). Each pass is one module here
whose docstring states the invariant it keeps; a pass is switched off with
``torch.compile(m, backend="boost", options={"<name>": False})``.
"""

from __future__ import annotations

from .activation_checkpoint import Checkpoint
from .base import BoostPass, PassContext
from .btp import BottleneckTP
from .detect_bottlenecks import DetectBottlenecks
from .functionalize import Functionalize
from .group_linears import GroupLinears
from .inline_regions import InlineRegions
from .online_norm import OnlineNorm
from .order import FRONT, PIPELINE, TP_REQUIRED
from .reduce_scatter_grads import ReduceScatterGrads

__all__ = [
    "PIPELINE",
    "TP_REQUIRED",
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
    "ReduceScatterGrads",
]
