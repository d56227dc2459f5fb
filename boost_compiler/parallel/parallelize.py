"""``parallelize``: make a single-device model bottleneck-aware tensor-parallel.

How a model written for one device runs on shards: its parameters are replaced by
real local shards (what the optimizer trains), and its forward by a dynamo-compiled
*shadow*: a copy of the module tree whose parameters are zero-memory placeholders
with the GLOBAL shapes, which refuse any computation outside dynamo's tracing
(:mod:`boost_compiler.ir.placeholder`). Dynamo therefore traces the user's code exactly as written
(``view(b, s, self.n_heads, ...)`` sees the global sizes), guards and recompiles for
new shapes, kwargs and train/eval as for any model, and hands each graph to the boost
backend, which rewrites it to local shapes with the collectives of BOOST and calls it
with the real shards in place of the placeholders. This module decides the plan and
cuts the shards; what ties the model to its shadow afterwards (the one ``_boost``
attribute, which ``nn.Module`` methods reach the shadow) is :mod:`.shadow`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._logging import get_logger
from ..backend import boost_backend
from ..errors import AlreadyParallelizedError, BoostError, PlanFileError
from ..ir.capture import CapturedGraph, capture
from ..ir.placeholder import ShadowParam, make_placeholder
from ..ir.subgraphs import calls, inlined_copy
from ..options import BoostOptions
from ..passes import TP_REQUIRED, PassContext
from ..passes.driver import run_pipeline
from ..tp.collectives import graph_collectives
from ..tp.groups import TPGroup, resolve_group
from ..tp.placement import Placement, R
from ..tp.plan import TPPlan, input_shapes
from .agreement import (
    agree,
    broadcast_from_first,
    canonical,
    digest,
    held_tensors,
    input_signature,
)
from .blocks import mark, marked, repeated_blocks
from .closures import Rebinding, plan_rebinding, rebind
from .plan_fit import check_blocks_fit, check_fits
from .shadow import ParallelState, ShadowForward, attach, is_shard, mark_shard, parallel_state

log = get_logger(__name__)


def synchronise_rng(group: TPGroup) -> None:
    """Give every rank of the group rank 0's random state (CPU and current accelerator).

    Why: the ranks then draw the same numbers in the same order, so dropout on
    a replicated (r-dim) tensor produces one mask everywhere and the replicas
    stay bit-identical; shards take their slice of a global mask
    (:func:`~boost_compiler.tp.sharded_ops.sharded_dropout`). Megatron's tensor-parallel
    ranks share their default generator's seed for the same reason.
    """
    pg = dist.distributed_c10d._resolve_process_group(group.name)
    states: list[Any] = [torch.get_rng_state()]
    if torch.cuda.is_available():  # the same on every rank, so the lists have one length
        states.append(torch.cuda.get_rng_state())
    dist.broadcast_object_list(states, group=pg, group_src=0)
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def local_shard(t: torch.Tensor, placement: Placement, group: TPGroup) -> torch.Tensor:
    return placement.shard(t.detach(), group.rank, group.size).clone()


def parallelize(
    model: nn.Module,
    tp_mesh: Any,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    plan: TPPlan | str | Path | None = None,
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` at the narrow point of every bottleneck.

    ``options`` are the backend's (e.g. ``{"online_norm": False}``): they decide
    the plan and the eager path; a ``torch.compile(model, backend="boost",
    options=...)`` of the result takes its own.

    ``plan``: a :class:`~boost_compiler.TPPlan`, or the path of one saved with
    ``plan.save(path)`` or by ``boost explain`` (``plan.json``), whose parameter
    placements are forced instead of decided (to pin a plan across versions, or to try
    an edited one). A plan that does not fit the model or the mesh raises
    :class:`~boost_compiler.errors.PlanMismatchError` naming every parameter at fault,
    before anything is modified; a placement the rules cannot use is gathered (exact),
    and the plan lists the gather under ``fallbacks``.

    Every rank of the group calls it, and they end as one model: rank 0's parameters
    and buffers are broadcast to the others before any is cut (as DDP and FSDP do when
    they wrap a model), so ranks that built the model from different seeds train rank
    0's. What cannot be made equal is compared first, on every rank: the model's
    parameter names, shapes and dtypes, ``options``, the plan (``plan=`` files included)
    and the example inputs' shapes; a difference raises
    :class:`~boost_compiler.errors.RankMismatchError` on every rank, and an error on one
    rank raises :class:`~boost_compiler.errors.PeerRankError` naming it on the others,
    before any parameter is modified. The first call of the model itself compares its inputs'
    shapes the same way (not later calls, each a collective, nor calls traced into a compiled
    caller's graph, where ShadowForward inlines the shadow without it).

    Returns the same module, its parameters now this rank's shards, its plan in
    ``model.boost_plan``. The forward keeps its signature; use it eagerly or
    with ``torch.compile(model, backend="boost")``.

    What the model's ``nn.Module`` methods do afterwards: ``forward`` runs the
    shadow (a copy of the module tree taken here, on global-shape placeholders).
    ``train()``/``eval()``, ``requires_grad_()``, ``load_state_dict()`` and the
    conversions built on ``_apply`` (``.to(dtype or device)``, ``.half()``,
    ``.bfloat16()``, ``.float()``, ``.double()``, ``.cuda()``, ``.to_empty()``), on
    the model or on any module inside it, change the shards and bring the shadow
    into step: the next call recompiles for the new dtype and computes what the
    single-device model converted the same way computes. Hooks on the model itself
    run as on any module; hooks on inner modules run if registered before
    ``parallelize`` (they are traced, on global shapes); registering one afterwards
    raises :class:`~boost_compiler.errors.HookAfterParallelizeError`, since those
    modules never run. Calling an inner module directly computes on its local
    shards, not the parallel computation: call the model.
    :func:`~boost_compiler.parallel_state` returns what this attached (the shadow,
    the plan, the group, the options).

    Example (run under ``torchrun --nproc-per-node 2``)::

        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        import boost_compiler
        from boost_compiler.models.cola_llama import build, example_inputs

        dist.init_process_group("gloo")
        model = build("tiny")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        boost_compiler.parallelize(model, mesh, example_inputs(model.cfg))
        loss = model(*example_inputs(model.cfg), labels=example_inputs(model.cfg)[0])
    """
    group = resolve_group(tp_mesh)
    try:  # checks only: any error of one rank is raised on every rank (agree, below)
        opts = BoostOptions.parse(options)
        _refuse_parallelized(model)
        rebindings = plan_rebinding(model)
        forced = _forced_plan(plan, model, group)
        decided, blocks = _decide(model, tuple(example_inputs), example_kwargs, opts, group,
                                  forced)  # fmt: skip
        shared: Mapping[str, Any] | BaseException = _shared(
            model, decided, options, example_inputs, example_kwargs
        )
    except Exception as exc:
        shared = exc
    agree(group, "parallelize", shared)
    # Every check above ran on the captured copy, on every rank: nothing was modified.
    broadcast_from_first(model, group)  # one model: rank 0's, whatever each rank built
    _shard_in_place(model, decided, group, dict(options or {}), rebindings, blocks)
    synchronise_rng(group)
    log.info(
        "parallelized %s over tp=%d: %d bottleneck(s), %d sharded parameter(s)",
        type(model).__name__,
        group.size,
        len(decided.bottlenecks),
        sum(pl.is_shard for pl in decided.params.values()),
    )
    model.boost_plan = decided  # type: ignore[assignment]
    return model


def _decide(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    opts: BoostOptions,
    group: TPGroup,
    forced: TPPlan | None,
) -> tuple[TPPlan, list[str]]:
    """The plan of the model's captured graphs, and the blocks kept as regions.

    The plan's ``route`` says which way the model compiles, and why not per block when
    it does not: a whole-model route is a slower first compile, which the user should
    see in the plan rather than only in an INFO log.
    """
    if not opts.settings["compile_blocks"]:
        blocks, why = [], "compile_blocks=False"
    else:
        blocks = repeated_blocks(model)
        why = "no repeated blocks (a ModuleList of two or more alike children)"
    graphs, kept, refused = _capture(model, example_inputs, example_kwargs, blocks)
    why = refused or why
    whole = [dataclasses.replace(g, gm=inlined_copy(g.gm)) for g in graphs] if kept else []
    decided = _plan(graphs, group, opts, forced)
    differ = (
        _differing_placements(model, decided, _plan(whole, group, opts, forced)) if kept else ""
    )
    if differ:
        # Planned again from a capture without regions: the inlined copy's nodes all
        # carry the first block's module path, which the plan's decisions would report.
        graphs, kept, _ = _capture(model, example_inputs, example_kwargs, [])
        decided = _plan(graphs, group, opts, forced)
        why = differ
    decided.route = f"per-block ({len(kept)} blocks)" if kept else f"whole model: {why}"
    if forced is not None:
        frozen = {n for n, prm in model.named_parameters() if not prm.requires_grad}
        check_blocks_fit(decided, frozen)
    return decided, kept


def _shared(
    model: nn.Module,
    decided: TPPlan,
    options: Mapping[str, Any] | None,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What every rank of the group must have alike to hold one model, shown per rank.

    Each tensor's device type: :func:`broadcast_from_first` skips meta tensors, so a rank
    built on meta would take fewer broadcasts than rank 0. The options as each rank resolves
    them (``compile_in_turns`` defaults from ``$BOOST_COMPILE_IN_TURNS``, read per process: a
    rank compiling in turns takes barriers the others never do). The plan's collectives and
    route, not only its placements: what each rank will issue.
    """
    tensors = [f"{n}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device.type}"
               for n, t in held_tensors(model)]  # fmt: skip
    opts = BoostOptions.parse(options)  # parsed once already: cannot raise here
    placements = {n: str(pl) for n, pl in sorted(decided.params.items())}
    issued = [(c.kind, [str(s) for s in c.global_shape], str(c.dtype), c.forward, c.backward)
              for c in decided.collectives]  # fmt: skip
    route = decided.route.split(":")[0]  # "per-block (N blocks)" or "whole model", no why
    return {
        "the model's tensors (names, shapes, dtypes, devices)": tensors,
        "options": canonical({**opts.passes, **opts.settings}),
        "example inputs": input_signature(example_inputs, example_kwargs),
        # The content, not the file's path: ranks may each read their own copy of a plan.
        "plan": f"{'forced by plan=' if decided.forced_from else 'decided'}, {route or 'no'} "
                f"route, placements digest {digest(placements)}, {len(issued)} collectives "
                f"digest {digest(issued)}",
    }  # fmt: skip


def _capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: Mapping[str, Any] | None,
    blocks: list[str],
) -> tuple[list[CapturedGraph], list[str], str]:
    """The model's graphs, its repeated blocks as regions; the blocks that could be; why
    none could ("" when they were, or when there were none to try).

    A block dynamo cannot trace whole (a graph break inside it) cannot be a region:
    then the model is captured as one graph, and its blocks are left unmarked. Any
    refusal of the capture with regions is retried so, and only that capture's raises.
    """

    def run() -> list[CapturedGraph]:
        return capture(model, example_inputs, example_kwargs,
                       refuse_parameter_writes=True, require_compiled=True)  # fmt: skip

    why = ""
    if blocks:
        try:
            with marked(model, blocks):
                graphs = run()
            if not any(_nested_calls(g.gm) for g in graphs):
                return graphs, blocks, ""
            why = "the blocks run inside another region (a torch.utils.checkpoint)"
        except BoostError as exc:  # the capture without regions says what is wrong, if anything
            why = f"the capture with blocks as regions failed ({str(exc).splitlines()[0][:200]})"
        log.info("compile_blocks: %s's blocks compile with the whole model: %s",
                 type(model).__name__, why)  # fmt: skip
    return run(), [], why


def _nested_calls(gm: torch.fx.GraphModule) -> bool:
    """Whether a region call sits in a body below ``gm``'s own graph (a checkpoint's).

    Regions are kept only where the top graph calls them: called from inside a
    checkpoint region, torch 2.13's dynamo failed the parallelized forward on one rank
    of two (a subclass guard on a value that was None), and the other waited for it in
    a collective (found by the fuzzer: a hang).
    """
    return any(calls(sub.graph) for sub in gm.modules() if sub is not gm and
               isinstance(sub, torch.fx.GraphModule))  # fmt: skip


def _differing_placements(model: nn.Module, per_block: TPPlan, whole: TPPlan) -> str:
    """Why the per-block plan cannot stand ("" when it can): a parameter it places
    otherwise than the model planned whole does.

    A bottleneck can span blocks (a dense MLP's down projection narrows to the hidden, and
    the next block's gate widens it again: found across the residual), which a block's
    body cannot see: planned alone, such a block keeps the dense projections whole.
    """
    differ = [n for n, pl in whole.params.items() if per_block.params.get(n) != pl]
    if not differ:
        return ""
    name = differ[0]
    why = (f"planned whole it places {len(differ)} parameter(s) otherwise than block by "
           f"block ({name!r}: {whole.params[name]} whole, {per_block.params.get(name)} per "
           "block)")  # fmt: skip
    log.info("compile_blocks: %s compiles as one graph: %s", type(model).__name__, why)
    return why


def _forced_plan(
    plan: TPPlan | str | Path | None, model: nn.Module, group: TPGroup
) -> TPPlan | None:
    """The plan whose placements ``parallelize(..., plan=)`` forces, checked to fit ``model``."""
    if plan is None:
        return None
    if not isinstance(plan, (TPPlan, str, Path)):
        raise PlanFileError(
            f"plan= takes a TPPlan or the path of a saved plan, got {type(plan).__name__}"
        )
    forced = plan if isinstance(plan, TPPlan) else TPPlan.load(plan)
    check_fits(forced, {n: tuple(prm.shape) for n, prm in model.named_parameters()}, group.size)
    return forced


def _plan(
    graphs: Sequence[CapturedGraph], group: TPGroup, opts: BoostOptions, forced: TPPlan | None
) -> TPPlan:
    """The pass pipeline on each captured graph (they are rewritten); the plan of the result.

    The backend's pipeline and options, so the plan lists the collectives a
    ``torch.compile(backend="boost", options=options)`` of the model executes. With a
    ``forced`` plan every parameter's placement is fixed from the start: the rules place
    the rest of each graph around them, as they do for a graph compiled later.
    """
    plan = TPPlan(p=group.size, group=group.name)
    if forced is not None:
        plan.params = dict(forced.params)
        plan.forced_from = forced.forced_from or "a TPPlan"
    for g in graphs:
        ctx = PassContext(g.param_names, tp=group, fixed=dict(plan.params))
        run_pipeline(g.gm, ctx, opts, required=TP_REQUIRED)
        plan.add_graph("parallelize", input_shapes(g.example_inputs), ctx.notes["btp"],
                       ctx.bottlenecks, graph_collectives(g.gm.graph))  # fmt: skip
    return plan


def _refuse_parallelized(model: nn.Module) -> None:
    """A second ``parallelize`` would shard the shards (and trace the placeholders)."""
    if parallel_state(model) is not None:
        raise AlreadyParallelizedError(
            f"{type(model).__name__} is already parallelized (its plan is model.boost_plan); "
            "call parallelize once per model, on the single-device model"
        )
    for name, prm in model.named_parameters():
        if is_shard(prm):
            raise AlreadyParallelizedError(
                f"parameter {name!r} of {type(model).__name__} is already a tensor-parallel "
                "shard: a part of a parallelized model cannot be parallelized again"
            )


def _shard_in_place(
    model: nn.Module,
    plan: TPPlan,
    group: TPGroup,
    options: dict[str, Any],
    rebindings: Sequence[Rebinding],
    blocks: Sequence[str] = (),
) -> None:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for name, prm in mod._parameters.items():
            if prm is None:
                continue
            owners.setdefault(id(prm), []).append((mod, name))
            first_name.setdefault(id(prm), f"{mod_name}.{name}" if mod_name else name)
            params[id(prm)] = prm

    memo: dict[int, Any] = {id(b): b for b in model.buffers()}
    records: dict[str, ShadowParam] = {}
    for key, prm in params.items():
        fqn = first_name[key]
        placement = plan.params.setdefault(fqn, R)
        plan.param_shapes[fqn] = tuple(prm.shape)
        plan.param_itemsize[fqn] = prm.element_size()
        if prm.requires_grad:
            plan.trainable.add(fqn)
        local = nn.Parameter(local_shard(prm, placement, group), prm.requires_grad)
        records[fqn] = ShadowParam(
            fqn, placement, group, owners[key][0], mark_shard(local, fqn), plan
        )
        memo[key] = make_placeholder(records[fqn], local, prm.shape)  # the shadow's parameter
        params[key] = local
    shadow = copy.deepcopy(model, memo)
    rebind(shadow, rebindings, memo)  # closures over modules call the shadow's copies
    mark(shadow, blocks)  # the shadow's blocks only: the model's classes stay its own
    for key, local in params.items():
        for mod, name in owners[key]:
            mod._parameters[name] = local
    backend = functools.partial(boost_backend, options={**options, "lowering": "eager"})
    forward = ShadowForward(shadow, backend, group)
    state = ParallelState(shadow, forward, plan, group, options, records)
    attach(model, state)
