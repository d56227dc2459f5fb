"""The pass driver: the one loop that runs the pipeline, for the backend, ``parallelize``
and ``explain``.

Invariant: on one graph and one :class:`~boost_compiler.passes.base.PassContext`, the
passes switched on by the options run once each, in pipeline order; ``on_stage`` sees
the graph before any pass (stage ``"input"``) and after each pass that ran, and the
graph module is recompiled once at the end. A pass's exception propagates unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import torch.fx as fx

from .._logging import get_logger
from ..errors import OptionTypeError
from ..ir.subgraphs import distinct_bodies
from .base import BoostPass, PassContext
from .order import PIPELINE

log = get_logger(__name__)


class PassOptions(Protocol):
    """What the driver reads of :class:`boost_compiler.options.BoostOptions`.

    A protocol, not an import: the options validate their names against
    :data:`.order.PIPELINE`, so they sit above the passes and the passes never import them.
    """

    @property
    def passes(self) -> Mapping[str, Any]: ...

    def enabled(self, name: str) -> bool: ...


#: ``on_stage(stage, gm, ctx)``: called with ``"input"`` first, then each pass's name.
OnStage = Callable[[str, fx.GraphModule, PassContext], None]


def enabled_passes(
    options: PassOptions, passes: Sequence[type[BoostPass]] | None = None
) -> list[type[BoostPass]]:
    """The passes of ``passes`` (default: the pipeline) that ``options`` leave on, in order."""
    return [cls for cls in _or_pipeline(passes) if options.enabled(cls.name)]


def _or_pipeline(passes: Sequence[type[BoostPass]] | None) -> Sequence[type[BoostPass]]:
    if passes is not None:
        return passes

    return PIPELINE


def run_pipeline(
    gm: fx.GraphModule,
    ctx: PassContext,
    options: PassOptions,
    passes: Sequence[type[BoostPass]] | None = None,
    *,
    required: Collection[str] = (),
    on_stage: OnStage | None = None,
) -> list[BoostPass]:
    """Run the enabled passes on ``gm`` in order; returns the pass objects that ran.

    ``required`` names passes the options may not switch off (a parallelized model
    needs the tensor-parallel rewrite and what it assumes); one that is off raises
    :class:`~boost_compiler.errors.OptionTypeError` before any pass runs.
    """
    off = [name for name in required if not options.enabled(name)]
    if off:
        raise OptionTypeError(
            "this model was prepared by boost_compiler.parallelize: the passes "
            f"{', '.join(map(repr, required))} cannot be switched off for it "
            f"(switched off: {', '.join(map(repr, off))})"
        )
    if ctx.run_body is None:  # a region's body gets the same pipeline (``tp/regions.py``)
        ctx.run_body = functools.partial(
            run_pipeline, options=options, passes=passes, required=required
        )
    if ctx.tp is None:  # no placements to plan bodies for: each distinct body once, here
        for body, names in distinct_bodies(gm, ctx.param_names):
            run_pipeline(body, PassContext(names, run_body=ctx.run_body), options, passes)
    todo = enabled_passes(options, passes)
    skipped = [cls.name for cls in _or_pipeline(passes) if cls not in todo]
    if skipped:
        log.debug("passes switched off: %s", ", ".join(skipped))
    if on_stage is not None:
        on_stage("input", gm, ctx)
    ran: list[BoostPass] = []
    for cls in todo:
        p = cls(ctx, options.passes[cls.name])
        p(gm.graph)
        ran.append(p)
        if on_stage is not None:
            on_stage(cls.name, gm, ctx)
    gm.recompile()
    return ran
