"""``detect``: capture a model and find its bottlenecks, as the backend's front passes see it.

In ``passes``, not beside :mod:`boost_compiler.analysis.bottlenecks` (the graph analysis,
which the passes import), because it runs passes itself: the in-place ops are made functional first, so that every reader
of a value sees what it reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck, find_bottlenecks
from ..ir.capture import CapturedGraph, capture
from . import FRONT, PassContext

log = get_logger(__name__)


def detect_in(graphs: Sequence[CapturedGraph]) -> list[Bottleneck]:
    """Bottlenecks over several captured graphs, deduplicated by factor names."""
    seen: set[tuple[str, str]] = set()
    out: list[Bottleneck] = []
    for g in graphs:
        for cls in FRONT:  # in-place ops made functional: readers see what they read
            cls(PassContext(g.param_names))(g.gm.graph)
        for b in find_bottlenecks(g.gm, g.param_names):
            if (b.down, b.up) not in seen:
                seen.add((b.down, b.up))
                out.append(b)
    return out


def detect(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> list[Bottleneck]:
    """Find every low-rank bottleneck ``d_in -> r -> d_out`` of ``model``.

    Works on real and meta-device models (nothing is computed for real on a
    meta model). Example::

        import torch, boost_compiler
        from torch import nn
        model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.SiLU(), nn.Linear(16, 64))
        [b] = boost_compiler.detect(model, (torch.randn(2, 64),))
        assert (b.down, b.up, b.rank, b.ops) == ("0.weight", "2.weight", 16, ("silu",))
    """
    graphs = capture(model, tuple(example_inputs), example_kwargs)
    found = detect_in(graphs)
    log.info("found %d bottleneck(s) in %s", len(found), type(model).__name__)
    return found
