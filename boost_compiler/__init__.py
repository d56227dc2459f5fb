"""boost-compiler: a torch.compile backend for low-rank bottleneck LLMs.

Write the model for one device; ``torch.compile(model, backend="boost")``
finds every low-rank bottleneck ``d_in -> r -> d_out`` from the graph's
structure and runs the boost passes before Inductor.

Example::

    import torch
    from torch import nn
    import boost_compiler

    model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.SiLU(), nn.Linear(16, 64))
    x = torch.randn(4, 64)
    for b in boost_compiler.detect(model, (x,)):
        print(b.down, "->", b.up, f"{b.d_in} -> {b.rank} -> {b.d_out}", b.ops)
    compiled = torch.compile(model, backend="boost")   # no import needed for this line
    assert torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-6)

The names here are the verbs (``detect``, ``explain``, ``parallelize``, ``to_low_rank``,
...), what they return (``TPPlan``, ``Report``, ...), the options and ``BoostError``;
every error the package raises is a ``BoostError`` subclass in :mod:`boost_compiler.errors`.
"""

from __future__ import annotations

from .analysis.bottleneck_table import bottleneck_table
from .analysis.bottlenecks import Bottleneck
from .backend import boost_backend
from .convert import ConversionReport, LayerConversion, LowRankLinear, to_low_rank
from .errors import BoostError
from .explain import Report, explain
from .ir.capture import CapturedGraph, capture
from .layouts import from_pretrained
from .options import BoostOptions
from .parallel.parallelize import parallelize
from .parallel.shadow import ParallelState, parallel_state
from .parallel.state_dict import gather_state_dict, load_state_dict, reset_parameters
from .passes.detect import detect
from .tp.placement import Placement
from .tp.plan import TPPlan

__version__ = "0.1.0"  # the one source: pyproject.toml reads it (dynamic version)

__all__ = [
    "BoostError",
    "BoostOptions",
    "Bottleneck",
    "CapturedGraph",
    "ConversionReport",
    "LayerConversion",
    "LowRankLinear",
    "ParallelState",
    "Placement",
    "Report",
    "TPPlan",
    "boost_backend",
    "bottleneck_table",
    "capture",
    "detect",
    "explain",
    "from_pretrained",
    "gather_state_dict",
    "load_state_dict",
    "parallel_state",
    "parallelize",
    "reset_parameters",
    "to_low_rank",
]
