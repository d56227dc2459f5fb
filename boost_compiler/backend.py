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

from collections.abc import Callable, Sequence
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
from .ir.placeholder import current_local, placeholder_record, shadow_param
from .ir.subgraphs import calls, inline_all
from .lowering import symm_mem
from .options import BoostOptions
from .passes import TP_REQUIRED, BoostPass, PassContext
from .passes.base import _digest
from .passes.checkpoint import inline_tagged_regions
from .passes.driver import run_pipeline
from .tp.collectives import graph_collectives
from .tp.plan import input_shapes, predicted_bytes

log = get_logger(__name__)


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
    # A parallelized model: run the rewritten graph on the real local shards in
    # place of the global-shape placeholders dynamo traced with.
    local_inputs = _local_example_inputs(example_inputs, shards)
    if opts.settings["lowering"] == "eager":
        fn: Callable[..., Any] = gm.forward
    elif opts.settings["compile_in_turns"]:
        fn = _in_turns(
            ctx.tp, lambda: _lower_with_inductor(gm, local_inputs, ran, opts, mode, ctx.tp)
        )
    else:
        fn = _lower_with_inductor(gm, local_inputs, ran, opts, mode, ctx.tp)
    return _with_local_shards(fn, sorted(shards), ctx.tp)


def _inline_regions(gm: fx.GraphModule, opts: BoostOptions) -> None:
    """Where a body cannot be lowered as a region, its calls are inlined (exact).

    Under ``lowering="eager"``: ``torch.compiler.nested_compile_region`` reaches a
    backend as ``invoke_subgraph`` nodes, whose backward torch runs only under
    AOTAutograd's fake mode: run as-is the graph fails in backward with a bare
    AssertionError. Under ``checkpoint``: torch 2.13 cannot partition a body that
    recomputes a random op (:func:`~boost_compiler.passes.checkpoint.inline_tagged_regions`).
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


def _in_turns(tp: Any, compile_: Callable[[], Any]) -> Any:
    """Compile on one rank of the group after another (option ``compile_in_turns``).

    The ranks' graphs differ only in a few rank offsets, so most generated
    kernels are identical: with a shared Inductor cache directory, rank i>0
    finds them compiled by rank 0 instead of compiling them again on the same
    cores at the same time. The backward graph is compiled now too (not lazily
    at the first backward), inside this rank's turn. Turns are taken with
    barriers on the group's own process group, outside any traced code; every
    rank compiles the same graphs in the same order (SPMD), so they match.

    A compile that raises still takes part in every barrier, and raises after
    them: dynamo restarts a frame's analysis by raising from inside the backend
    (with ``dynamic=True``, its scalar-tensorify pass does), and a rank leaving
    the turns early would pair its next barrier with another rank's collective.
    """
    pg = torch.distributed.distributed_c10d._resolve_process_group(tp.name)
    fn, error = None, None
    for turn in range(tp.size):
        if turn == tp.rank:
            try:
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    fn = compile_()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the turns
                error = exc
        torch.distributed.barrier(group=pg)
    if error is not None:
        raise error
    return fn


def _local_example_inputs(example_inputs: Sequence[Any], shards: dict[int, Any]) -> list[Any]:
    """The example inputs with each global placeholder replaced by this rank's shard.

    The shards go in as static fake tensors of dynamo's fake mode. Dynamo
    fakified the global placeholders (static: parameters), never the shards;
    AOTAutograd would fakify a real shard itself and, under ``dynamic=True``,
    give its sizes fresh symbols duck-sized onto equal activation sizes (a
    16-row weight and a 16-token sequence share one symbol). No guard covers
    that, and the next sequence length breaks the compiled graph.
    """
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    out = list(example_inputs)
    for i, x in shards.items():
        local = current_local(x)
        out[i] = local if fake_mode is None else fake_mode.from_tensor(local, static_shapes=True)
    return out


def _with_local_shards(fn: Callable[..., Any], positions: list[int], tp: Any) -> Callable[..., Any]:
    """Call ``fn`` with each placeholder argument replaced by its local shard, per call.

    The shard is looked up on the argument at run time, never bound at compile
    time: dynamo lifts parameters to graph inputs without guarding on their
    identity, so two parallelized instances of one model class share this
    compiled graph, and each must run on its own shards.
    """

    def run(*args: Any) -> Any:
        args_ = list(args)
        for i in positions:
            record = placeholder_record(args_[i])
            if record.group != tp:
                raise ShardingError(
                    f"a graph compiled for tensor-parallel group {tp} was called with "
                    f"parameter {record.fqn!r} of group {record.group}; "
                    "compile each differently parallelized model separately"
                )
            args_[i] = current_local(args_[i])
        return fn(*args_)  # dynamo calls a backend's result positionally

    return run


def _symm_mem_patches(tp: Any, opts: BoostOptions) -> dict[str, Any]:
    """Option ``symm_mem_all_reduce`` on the group ``tp`` (``lowering/symm_mem.py``)."""
    if not opts.settings["symm_mem_all_reduce"]:
        return {}
    import torch.distributed as dist

    from .device import group_backend

    pg = dist.distributed_c10d._resolve_process_group(tp.name)
    # symmetric memory is CUDA memory: what counts is the backend of the CUDA tensors
    return symm_mem.inductor_patches(
        tp.name, group_backend(pg, "cuda"), opts.settings["symm_mem_all_reduce"],
        opts.settings["collective_wait"], opts.settings["overlap_comm"],
    )  # fmt: skip


def _lower_with_inductor(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    ran: Sequence[BoostPass],
    opts: BoostOptions,
    mode: str | None,
    tp: Any = None,
) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(list_mode_options(mode))
    if tp is not None:
        patches.update(_symm_mem_patches(tp, opts))
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
    patches["post_grad_custom_post_pass"] = _PostGrad(
        [p.uuid() for p in ran],
        opts.settings["collective_wait"],
        opts.settings["overlap_comm"],
        user_pass,
    )
    if opts.settings["overlap_comm"] and "_post_fusion_custom_pass" not in patches:
        patches["_post_fusion_custom_pass"] = lowering.OverlapSchedule()
        # its peak-memory re-ordering runs after, and would undo the overlap
        patches.setdefault("reorder_for_peak_memory", False)
    # Inductor config must travel as config_patches: a `with config.patch()`
    # around compile_fx would miss the lazily compiled backward graph. Donated backward
    # buffers are decided here, in the forward's compile: with regions, torch 2.13 applies
    # the top graph's donation indices to a body's inputs (pytorch/pytorch#193960).
    with torch._functorch.config.patch(donated_buffer=not regions):
        return compile_fx(gm, example_inputs, config_patches=patches)


__all__ = ["boost_backend"]
