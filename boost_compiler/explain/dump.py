"""Dump each pass's graph while the boost pipeline runs (``diff`` shows what a pass did).

Invariant: a :class:`GraphDumper` is a pass driver's ``on_stage`` callback for one
graph; with the backend option ``dump_dir`` (or ``BOOST_DUMP_DIR``) set it writes,
under ``<dir>/graph_<n>/``, one ``<i>_<stage>.py`` per stage (``00_input.py``, then
each pass that ran: the graph's readable code), with ``<i>_<stage>.layers.dot``
(one box per layer) and, up to :data:`MAX_FULL_NODES` nodes, ``<i>_<stage>.dot``
(every node, coloured by placement, collectives as hexagons) and their ``.svg``
when graphviz's ``dot`` is installed; with torch's structured trace on
(``TORCH_TRACE``) each stage is also an artifact ``boost_<i>_<stage>`` for
``tlparse``; with neither, it costs nothing.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch.fx as fx
from torch._logging import trace_structured
from torch._logging._internal import trace_log

from .._logging import get_logger

log = get_logger(__name__)
ENV_VAR = "BOOST_DUMP_DIR"
MAX_FULL_NODES = 600  # larger graphs get the per-layer drawing only (dot is slow on thousands)
_graph_ids = itertools.count()


def tracing() -> bool:
    """Whether torch's structured trace (``TORCH_TRACE``) is being written."""
    return bool(trace_log.handlers)


class GraphDumper:
    """Writes the stages of one graph; a no-op when no directory is configured and no
    structured trace is on.

    ``name`` names the graph's folder (default ``graph_<n>``, n counting the graphs of
    this process); ``drawings=False`` writes the code only.
    """

    def __init__(
        self, out_dir: str | None = None, name: str | None = None, drawings: bool = True
    ) -> None:
        root = out_dir or os.environ.get(ENV_VAR)
        self.name = name or f"graph_{next(_graph_ids)}"
        self.dir = Path(root) / self.name if root else None
        self.drawings = drawings
        self.step = 0

    def __call__(self, stage: str, gm: fx.GraphModule, ctx: object = None) -> None:
        """Dump ``gm`` as it is after ``stage`` (a pass driver's ``on_stage`` callback);
        ``ctx`` (a PassContext) adds parameter names and bottlenecks to the drawings."""
        trace = tracing()
        if self.dir is None and not trace:
            return
        gm.recompile()
        slug = f"{self.step:02d}_{stage}"
        self.step += 1
        code = gm.print_readable(print_output=False)
        if trace:
            trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": f"boost_{slug}", "encoding": "string"},
                payload_fn=lambda: code,
            )
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{slug}.py"
        path.write_text(code)
        log.debug("boost: wrote %s", path)
        if self.drawings:
            self._draw(slug, stage, gm, ctx)

    def _draw(self, slug: str, stage: str, gm: fx.GraphModule, ctx: object) -> None:
        from ..tp.collectives import graph_collectives
        from . import draw

        assert self.dir is not None
        params = dict(getattr(ctx, "param_names", None) or {})
        if not params:
            from ..ir.capture import fqn_from_source

            for n in gm.graph.nodes:
                source = getattr(n.meta.get("grapharg"), "source", None)
                fqn = fqn_from_source(source.name) if source is not None else None
                if n.op == "placeholder" and fqn:
                    params[n.name] = fqn
        view = draw.GraphView(
            gm, params, None, graph_collectives(gm.graph), getattr(ctx, "bottlenecks", ()) or (),
            title=f"{self.name} after {stage}",
        )  # fmt: skip
        draw.render(view.model_dot(), self.dir / f"{slug}.layers.dot")
        if len(view.nodes) <= MAX_FULL_NODES:
            draw.render(view.full_dot(), self.dir / f"{slug}.dot")
        if tracing():
            text = view.model_dot()
            trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": f"boost_{slug}_layers_dot", "encoding": "string"},
                payload_fn=lambda: text,
            )
