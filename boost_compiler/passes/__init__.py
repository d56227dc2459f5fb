"""The boost pass pipeline, in the order the backend runs it.

Each pass is one module here; its docstring states the invariant it keeps.
A pass is switched off with ``torch.compile(m, backend="boost",
options={"<name>": False})``.
"""

from __future__ import annotations

from .base import BoostPass, PassContext
from .btp import BottleneckTP
from .detect_bottlenecks import DetectBottlenecks

PIPELINE: tuple[type[BoostPass], ...] = (DetectBottlenecks, BottleneckTP)

__all__ = ["PIPELINE", "BoostPass", "BottleneckTP", "PassContext", "DetectBottlenecks"]
