"""The contract every boost pass follows.

A pass is a :class:`torch._inductor.custom_graph_pass.CustomGraphPass`: it takes
an ``fx.Graph``, rewrites it in place and returns it, and its ``uuid()`` covers
its own source code, its setting and whatever analysis result it acts on. That
last part matters: Inductor's FX-graph and AOTAutograd caches key on the code
of the graph they receive and on the uuids of registered custom passes, not on
``node.meta``; a pass that only annotates metadata would otherwise come back
stale from a warm cache (see TORCH_NOTES).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..analysis.bottlenecks import Bottleneck


@dataclass
class PassContext:
    """What the pipeline knows about the graph being compiled.

    ``param_names`` maps placeholder node names to parameter FQNs. Passes add
    their findings to ``bottlenecks`` / ``notes`` so later passes and the
    compile report can read them.
    """

    param_names: dict[str, str] = field(default_factory=dict)
    bottlenecks: list[Bottleneck] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    # Set for a model prepared by ``parallelize``: its group and parameter placements.
    tp: Any = None
    fixed: dict[str, Any] = field(default_factory=dict)
    # A nested compile region's body planned for one set of input placements (its
    # non-parameter placeholders' by name): the btp pass places them so, and leaves its
    # outputs as they are (``tp/regions.py``). None for a top-level graph.
    inputs: dict[str, Any] | None = None
    # Set by the driver: runs the pipeline on another graph (a region's body) with its own
    # context, ``run_body(gm, ctx)``.
    run_body: Any = None

    def signature(self) -> str:
        """A stable digest of the analysis results, folded into pass uuids."""
        return _digest(
            repr(sorted(self.param_names.items())),
            repr(self.bottlenecks),
            repr(self.tp),
            repr(sorted((k, str(v)) for k, v in self.fixed.items())),
            repr(sorted((k, str(v)) for k, v in (self.inputs or {}).items())),
        )


class BoostPass(CustomGraphPass):
    """Base class: subclasses set ``name``, ``default`` and implement ``run``.

    ``setting`` is the value given by ``options={name: ...}`` (``True`` when
    left at the default); ``allowed`` lists the non-bool values a pass accepts.
    """

    name: ClassVar[str]
    default: ClassVar[Any] = True
    allowed: ClassVar[tuple[Any, ...]] = ()
    # Modules whose code decides what the pass produces, besides the pass's own.
    depends_on: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: PassContext, setting: Any = True) -> None:
        self.ctx = ctx
        self.setting = setting

    def run(self, graph: fx.Graph) -> None:
        raise NotImplementedError

    def __call__(self, graph: fx.Graph) -> fx.Graph:  # type: ignore[override]
        self.run(graph)
        graph.lint()
        return graph

    def uuid(self) -> str:
        modules = [type(self).__module__, *self.depends_on]
        return _digest(
            type(self).__qualname__,
            *(inspect.getsource(importlib.import_module(m)) for m in modules),
            repr(self.setting),
            self.ctx.signature(),
        )


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()
