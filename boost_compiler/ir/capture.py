"""Capture: the model's forward as dynamo FX graphs, shapes from fake tensors.

The backend receives exactly this kind of graph from ``torch.compile``; the
analysis entry points (``detect``, ``parallelize``) capture it themselves with a
recording backend so that every component sees one IR: torch-level ops
(``F.linear``, ``torch.matmul``, ``F.silu``...), parameters as placeholders,
shapes in ``node.meta["example_value"]``. Works on meta-device models: dynamo
only needs fake tensors, and the recorded graph is run on meta tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .._dynamo_compat import tracing_patches
from .._logging import get_logger
from ..errors import BoostError, CaptureError, MutationError, UncompiledFrameError
from .placeholder import shadow_param

log = get_logger(__name__)


@dataclass
class CapturedGraph:
    """One dynamo graph plus the names of the parameters its placeholders hold."""

    gm: fx.GraphModule
    example_inputs: list[Any]
    # placeholder node name -> fully-qualified name as in model.named_parameters()
    param_names: dict[str, str] = field(default_factory=dict)
    # placeholder node name -> fully-qualified buffer name
    buffer_names: dict[str, str] = field(default_factory=dict)

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


_SOURCE_TOKEN = re.compile(
    r"\._(?:modules|parameters|buffers)\['([^']+)'\]"  # L['self']._modules['layers']
    r"|\.([A-Za-z_]\w*)"  # L['self'].layers
    r"|\[(\d+)\]"  # ...layers[0]
)


def fqn_from_source(source_name: str) -> str | None:
    """``L['self']._modules['layers']._modules['0']._parameters['w']`` -> ``layers.0.w``.

    Dynamo names a parameter placeholder by the attribute path it was read
    from. Returns None for a source that does not start at the module itself.
    """
    head = re.match(r"L\['(self|mod|model|fn)'\]", source_name)
    if head is None:
        return None
    parts: list[str] = []
    for m in _SOURCE_TOKEN.finditer(source_name, head.end()):
        parts.append(next(g for g in m.groups() if g is not None))
    return ".".join(parts) or None


def placeholder_names(
    gm: fx.GraphModule, example_inputs: Sequence[Any], model: nn.Module | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """Map placeholders to parameter and buffer FQNs.

    With the model at hand the mapping is by object identity (exact, also for
    tied parameters: the first name ``named_parameters`` gives wins). Without
    it (inside the backend) the dynamo source name is parsed.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    by_id_p: dict[int, str] = {}
    by_id_b: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id_p.setdefault(id(p), name)
        for name, b in model.named_buffers(remove_duplicate=False):
            by_id_b.setdefault(id(b), name)
    for node, value in zip(placeholders, example_inputs, strict=False):
        if model is not None:
            if id(value) in by_id_p:
                params[node.name] = by_id_p[id(value)]
            elif id(value) in by_id_b:
                buffers[node.name] = by_id_b[id(value)]
            continue
        if not isinstance(value, torch.Tensor):
            continue
        record = shadow_param(value)
        if record is not None:  # a parallelized model's global-shape placeholder
            params[node.name] = record.fqn
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        fqn = fqn_from_source(source.name) if source is not None else None
        if fqn is None:
            continue
        if isinstance(value, nn.Parameter):
            params[node.name] = fqn
        elif "_buffers[" in source.name:
            buffers[node.name] = fqn
    return params, buffers


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    refuse_parameter_writes: bool = False,
    require_compiled: bool = False,
) -> list[CapturedGraph]:
    """Trace ``model(*example_inputs, **example_kwargs)`` with dynamo.

    Returns every graph dynamo produced (more than one when the model has
    graph breaks). Raises :class:`CaptureError` when the inputs do not run
    through the model, with the model's own exception chained. The model runs
    once, but graph inputs its forward writes into (a running statistic, a
    cache) are given copies: capturing changes no buffer, parameter or input.
    With ``refuse_parameter_writes`` a forward that writes into a parameter
    raises :class:`MutationError` before it runs. With ``require_compiled`` a
    frame that dynamo could not compile (it runs such a frame, and all it calls,
    as Python: e.g. after a graph break inside a loop over modules) raises
    :class:`UncompiledFrameError`: a parallelized model would run that code on
    placeholders.
    """
    from .writes import describe_write, written_inputs

    graphs: list[CapturedGraph] = []

    def record(gm: fx.GraphModule, inputs: list[Any]) -> Any:
        params, buffers = placeholder_names(gm, inputs, model)
        graphs.append(CapturedGraph(gm, list(inputs), params, buffers))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        written = written_inputs(gm.graph)
        for i, node in written.items():
            fqn = params.get(placeholders[i].name)
            if fqn is not None and refuse_parameter_writes:
                raise MutationError(
                    f"{describe_write(node)} writes into parameter {fqn!r} during the forward; "
                    "a parallelized parameter is a shard on each rank. Change parameters "
                    "outside the forward (e.g. under torch.no_grad() before the call)"
                )
        if not written:
            return gm.forward

        def on_copies(*args: Any) -> Any:
            args_ = list(args)
            for i in written:
                args_[i] = args_[i].detach().clone()
            return gm.forward(*args_)

        return on_copies

    kwargs = dict(example_kwargs or {})
    # Capture must not be cut short by the recompile limit when many models of
    # one class are analysed in one process (dynamo caches per code object).
    from torch._dynamo.utils import counters

    frames = dict(counters["frames"])
    # tracing_patches: a gradient-checkpointed HF model traces with `kernels` installed.
    with torch._dynamo.config.patch(
        **tracing_patches(),
        recompile_limit=10_000,
        accumulated_recompile_limit=100_000,
        fail_on_recompile_limit_hit=True,
    ):
        compiled = torch.compile(model, backend=record, dynamic=False)
        try:
            compiled(*example_inputs, **kwargs)
            if not graphs:
                # Dynamo marks a frame "run as Python" for good once it hit its recompile
                # limit in an earlier compile of this process; clear that for the model's
                # own forwards (nothing else of the process's caches) and trace again.
                for code in {type(m).forward.__code__ for m in model.modules()}:
                    torch._dynamo.eval_frame.remove_from_cache(code)
                compiled(*example_inputs, **kwargs)
        except Exception as exc:  # the model's own error, re-raised with context
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, BoostError):  # ours, from inside the recording backend
                raise inner from None
            raise CaptureError(
                f"{type(model).__name__} did not run with the example inputs "
                f"({_describe(example_inputs, kwargs)}): {type(exc).__name__}: {exc}"
            ) from exc
    failed = (counters["frames"]["total"] - frames.get("total", 0)) - (
        counters["frames"]["ok"] - frames.get("ok", 0)
    )
    if failed and require_compiled:
        # Dynamo gave up on a frame and runs it as Python; the frames it calls are still
        # compiled, so only parameters read by that frame itself (or by torch.nn modules
        # it calls, whose frames dynamo skips) miss every graph: those would compute on
        # placeholders. (An unused parameter is refused too: it cannot be told apart.)
        in_graphs = {fqn for g in graphs for fqn in g.param_names.values()}
        outside = [n for n, p in model.named_parameters() if n not in in_graphs]
        if outside:
            reasons = sorted({str(r).splitlines()[0] for r in counters["graph_break"]})
            raise UncompiledFrameError(
                f"dynamo could not compile {failed} frame(s) of {type(model).__name__} and runs "
                f"them as Python, reading parameter(s) {outside[:4]} there (e.g. a graph break "
                "inside a loop over modules makes dynamo skip the loop's frame); a "
                "parallelized model would compute them on placeholders, not on this rank's "
                f"shards. Graph breaks seen: {reasons[:3]}. Remove them (TORCH_LOGS="
                "graph_breaks shows where), or move them out of loops"
            )
    if not graphs:
        raise CaptureError(
            f"dynamo produced no graph for {type(model).__name__}; is its forward empty "
            "or wrapped in torch.compiler.disable?"
        )
    log.debug("captured %d graph(s) from %s", len(graphs), type(model).__name__)
    return graphs


def _describe(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor{tuple(v.shape)} {v.dtype} on {v.device}"
        return type(v).__name__

    items = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(items) or "no inputs"
