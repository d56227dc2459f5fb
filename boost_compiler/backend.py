"""The ``boost`` torch.compile backend: run the pass pipeline, lower with Inductor.

Registered through the ``torch_dynamo_backends`` entry point in pyproject, so
``torch.compile(model, backend="boost")`` works without importing this package.

Example::

    import torch
    from torch import nn
    model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.SiLU(), nn.Linear(16, 64))
    compiled = torch.compile(model, backend="boost", options={"lowering": "eager"})
    y = compiled(torch.randn(2, 64))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import lowering
from ._logging import get_logger
from .errors import ShardingError
from .explain.dump import GraphDumper
from .ir.capture import placeholder_names
from .ir.placeholder import shadow_param
from .ir.subgraphs import calls, inline_all
from .options import BoostOptions
from .passes import TP_REQUIRED, BoostPass, PassContext
from .passes.activation_checkpoint import inline_tagged_regions
from .passes.base import _digest
from .passes.driver import run_pipeline
from .tp.collectives import graph_collectives
from .tp.plan import input_shapes, predicted_bytes

log = get_logger(__name__)

#: ``(gm, example_inputs, shards, tp, ran, opts, mode) -> callable``: how a graph of a
#: parallelized model is lowered and run on the local shards. The parallel layer sits
#: above the backend (``parallelize`` compiles its shadow through ``boost_backend``),
#: so it registers this on import (:mod:`boost_compiler.parallel.runtime`); only a model
#: it parallelized has placeholders, so it is always imported when one is compiled.
ParallelCompile = Callable[..., Callable[..., Any]]
_parallel_compile: ParallelCompile | None = None


def register_parallel_compile(fn: ParallelCompile) -> None:
    """Install how a parallelized model's graphs compile (called by the parallel layer)."""
    global _parallel_compile
    _parallel_compile = fn


class _PostGrad(CustomGraphPass):
    """The boost passes over Inductor's post-grad graphs, its uuid the whole pipeline's.

    Registered as ``post_grad_custom_post_pass``, it runs on the forward and the backward
    graph (:mod:`.lowering`: collectives split into a start and a polled wait). The
    dynamo-graph passes run before Inductor sees the graph, so a changed graph already
    changes the cache key; metadata-only changes do not: every boost pass's uuid is folded
    into Inductor's and AOTAutograd's cache keys here, with the post-grad settings.
    """

    def __init__(self, uuids: Sequence[str], wait: str, overlap: bool, inner: Any = None) -> None:
        self.uuids = (*uuids, f"wait={wait},overlap={overlap}", lowering.SOURCE_DIGEST)
        self.wait, self.overlap = wait, overlap
        self.inner = inner  # a user's own post_grad_custom_post_pass, kept working

    def __call__(self, graph: fx.Graph) -> None:
        counters["boost"]["split_collectives"] += lowering.post_grad(graph, self.wait, self.overlap)
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> str | None:  # type: ignore[override]
        if self.inner is None:
            return _digest(*self.uuids)
        inner = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
        # A user's pass without a uuid: no key can say what it does, so none is claimed
        # and Inductor bypasses its cache, as it would for that pass alone (a cached
        # graph would skip it silently).
        return None if inner is None else _digest(*self.uuids, inner)


def boost_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """torch.compile backend entry point (see module docstring)."""
    opts = BoostOptions.parse(options)
    params, _ = placeholder_names(gm, example_inputs)
    ctx = PassContext(param_names=params)
    records = {i: r for i, x in enumerate(example_inputs) if (r := shadow_param(x)) is not None}
    shards = {i: example_inputs[i] for i in records}
    if shards:
        ctx.tp = next(iter(records.values())).group
        ctx.fixed = {r.fqn: r.placement for r in records.values()}
    ran = run_pipeline(
        gm, ctx, opts,
        required=TP_REQUIRED if shards else (),
        on_stage=GraphDumper(opts.settings.get("dump_dir")),
    )  # fmt: skip
    if shards:  # the model's plan lists every graph rewritten for it, and what it gathered
        btp = ctx.notes.get("btp")
        next(iter(records.values())).plan.record_graph(
            "compile", input_shapes(example_inputs), list(getattr(btp, "fallbacks", [])),
            len(graph_collectives(gm.graph)), predicted_bytes(btp) if btp is not None else 0.0,
        )  # fmt: skip
    _inline_regions(gm, opts)  # after the passes: each body was planned as it compiles
    counters["boost"]["graphs"] += 1
    counters["boost"]["bottlenecks"] += len(ctx.bottlenecks)
    log.info(
        "boost: compiled a graph of %d nodes with passes [%s]",
        len(gm.graph.nodes),
        ", ".join(p.name for p in ran),
    )
    if not shards:
        if opts.settings["lowering"] == "eager":
            return gm.forward
        return _lower_with_inductor(gm, list(example_inputs), ran, opts, mode)
    # A parallelized model: the user-facing layer above compiles it (its placeholders
    # are that layer's; see register_parallel_compile).
    if _parallel_compile is None:
        raise ShardingError(
            "a graph holds the placeholders of a parallelized model, but no runtime for "
            "them is registered: import boost_compiler (boost_compiler.parallel.runtime)"
        )
    return _parallel_compile(gm, example_inputs, shards, ctx.tp, ran, opts, mode)


def _inline_regions(gm: fx.GraphModule, opts: BoostOptions) -> None:
    """Where a body cannot be lowered as a region, its calls are inlined (exact).

    Under ``lowering="eager"``: ``torch.compiler.nested_compile_region`` reaches a
    backend as ``invoke_subgraph`` nodes, whose backward torch runs only under
    AOTAutograd's fake mode: run as-is the graph fails in backward with a bare
    AssertionError. Under ``checkpoint``: torch 2.13 cannot partition a body that
    recomputes a random op (:func:`~boost_compiler.passes.activation_checkpoint.inline_tagged_regions`).
    Under Inductor, a body computing on complex tensors: :func:`_holds_complex`.
    The bodies are inlined as the passes left them, so every lowering of a parallelized
    model runs the same per-block plan (planned whole, a model's parameters fixed per
    block could meet a rule that wants them otherwise: a gather).
    """
    if opts.enabled("checkpoint") and calls(gm.graph):
        n = inline_tagged_regions(gm)
        log.info("boost: %d nested compile region call(s) inlined: checkpoint=%r",
                 n, opts.passes["checkpoint"])  # fmt: skip
    elif opts.settings["lowering"] == "eager" and (n := inline_all(gm)):
        log.debug("boost: %d nested compile region call(s) inlined for eager lowering", n)
    elif calls(gm.graph) and _holds_complex(gm) and (n := inline_all(gm)):
        log.info("boost: %d nested compile region call(s) inlined: a body computes on complex "
                 "tensors (rotary as view_as_complex)", n)  # fmt: skip


def _holds_complex(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` or a body it calls computes a complex value. torch 2.13's backward of
    a region (``invoke_subgraph``) that does has no kernel at the Conjugate dispatch key
    (``NotImplementedError`` when Inductor compiles the backward): Meta's rotary embedding
    (``view_as_complex``) per block."""
    return any(
        node.target in _COMPLEX_MAKERS or any(
            isinstance(v := node.meta.get(key), torch.Tensor) and v.is_complex()
            for key in ("val", "example_value"))
        for sub in gm.modules() if isinstance(sub, fx.GraphModule)
        for node in sub.graph.nodes
    )  # fmt: skip


# Ops whose result is complex (a rewritten graph's nodes may carry no recorded value).
_COMPLEX_MAKERS = (torch.view_as_complex, torch.polar, torch.complex)


def _lower_with_inductor(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    ran: Sequence[BoostPass],
    opts: BoostOptions,
    mode: str | None,
    extra_patches: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Lower ``gm`` with Inductor; ``extra_patches`` (a parallelized model's symmetric-memory
    options) go over ``mode``'s Inductor options and under the user's ``inductor_config``."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(list_mode_options(mode))
    patches.update(extra_patches or {})
    patches.update(opts.settings["inductor_config"] or {})
    regions = bool(calls(gm.graph))
    if regions:
        # torch 2.13's Inductor takes a nested compile region's inputs for its own: a body
        # reused the buffer of its incoming gradient (which the caller still reads), and
        # wrote a pointwise result in place into the block's input (which its backward
        # still reads), so every call but the last computed wrong weight gradients: 10%
        # off on a CoLA block's norm weights, 63% on a block whose input is written after
        # it (tests/test_blocks.py, tests/test_mutation.py). Without buffer reuse and
        # in-place buffers the bodies are exact; buffers are still freed when dead.
        patches["allow_buffer_reuse"] = False
        patches["inplace_buffers"] = False
    user_pass = patches.get(
        "post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass
    )
    # "auto" reaches here unresolved only for a graph of no parallelized model: off
    overlap = opts.settings["overlap_comm"] is True
    patches["post_grad_custom_post_pass"] = _PostGrad(
        [p.uuid() for p in ran], opts.settings["collective_wait"], overlap, user_pass
    )
    if overlap and "_post_fusion_custom_pass" not in patches:
        patches["_post_fusion_custom_pass"] = lowering.OverlapSchedule()
        # its peak-memory re-ordering runs after, and would undo the overlap
        patches.setdefault("reorder_for_peak_memory", False)
    # Inductor config must travel as config_patches: a `with config.patch()`
    # around compile_fx would miss the lazily compiled backward graph. Donated backward
    # buffers are decided here, in the forward's compile: with regions, torch 2.13 applies
    # the top graph's donation indices to a body's inputs (pytorch/pytorch#193960).
    with torch._functorch.config.patch(donated_buffer=not regions):
        return compile_fx(gm, example_inputs, config_patches=patches)


__all__ = ["boost_backend", "register_parallel_compile"]
