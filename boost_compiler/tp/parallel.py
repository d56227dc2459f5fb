"""``parallelize``: make a single-device model bottleneck-aware tensor-parallel.

How a model written for one device runs on shards: its parameters are
replaced by real local shards (what the optimizer trains), and its forward by
a dynamo-compiled *shadow*: a copy of the module tree whose parameters are
stride-0 NaN placeholders with the GLOBAL shapes. Dynamo therefore traces the
user's code exactly as written (``view(b, s, self.n_heads, ...)`` sees the
global sizes), guards and recompiles for new shapes, kwargs and train/eval as
for any model, and hands each graph to the boost backend, which rewrites it to
local shapes with the collectives of BOOST and calls it with the real shards
in place of the placeholders. The placeholders hold no memory and are NaN so
that a graph which bypassed the rewrite could not silently produce numbers.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._logging import get_logger
from ..analysis.bottlenecks import find_bottlenecks
from ..errors import AlreadyParallelizedError, MeshError, UncompiledFrameError
from ..ir.capture import capture
from ..options import BoostOptions
from ..passes import FRONT, TP_PASSES, PassContext
from .collectives import group_name_of
from .placement import Placement, R
from .plan import TPPlan

log = get_logger(__name__)


@dataclass(frozen=True)
class TPGroup:
    name: str
    size: int
    rank: int


def resolve_group(mesh_or_group: Any) -> TPGroup:
    """A 1-D DeviceMesh or a ProcessGroup -> name, size, this rank's index."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise MeshError(
                f"parallelize needs a 1-D tensor-parallel mesh, got a {mesh_or_group.ndim}-D "
                f"mesh with dims {mesh_or_group.mesh_dim_names}; pass mesh['tp']"
            )
        pg = mesh_or_group.get_group()
    elif isinstance(mesh_or_group, dist.ProcessGroup):
        pg = mesh_or_group
    else:
        raise MeshError(
            f"parallelize takes a 1-D DeviceMesh or a ProcessGroup, got {type(mesh_or_group)!r}"
        )
    return TPGroup(group_name_of(pg), dist.get_world_size(pg), dist.get_rank(pg))


def synchronise_rng(group: TPGroup) -> None:
    """Give every rank of the group rank 0's random state (CPU and current accelerator).

    Why: the ranks then draw the same numbers in the same order, so dropout on
    a replicated (r-dim) tensor produces one mask everywhere and the replicas
    stay bit-identical; shards take their slice of a global mask
    (:func:`~boost_compiler.tp.kernels.sharded_dropout`). Megatron's tensor-parallel
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


def current_local(placeholder: nn.Parameter) -> torch.Tensor:
    """The tensor the owning module holds for this parameter now.

    Looked up at every call, not fixed at ``parallelize`` time, so whatever
    replaces the module's parameter is what runs: ``load_state_dict(assign=True)``,
    or FSDP2, which swaps in the all-gathered parameter for the forward.
    """
    mod, name = placeholder._boost_owner  # type: ignore[attr-defined]
    current = mod._parameters.get(name)
    return placeholder._boost_local if current is None else current  # type: ignore[attr-defined]


def local_shard(t: torch.Tensor, placement: Placement, group: TPGroup) -> torch.Tensor:
    return placement.shard(t.detach(), group.rank, group.size).clone()


def parallelize(
    model: nn.Module,
    tp_mesh: Any,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` at the narrow point of every bottleneck.

    ``options`` are the backend's (e.g. ``{"online_norm": False}``): they decide
    the plan and the eager path; a ``torch.compile(model, backend="boost",
    options=...)`` of the result takes its own.

    Returns the same module, its parameters now this rank's shards, its plan in
    ``model.boost_plan``. The forward keeps its signature; use it eagerly or
    with ``torch.compile(model, backend="boost")``. Example (run under
    ``torchrun --nproc-per-node 2``)::

        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        import boost_compiler
        from examples.cola_llama import build, example_inputs

        dist.init_process_group("gloo")
        model = build("tiny")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        boost_compiler.parallelize(model, mesh, example_inputs(model.cfg))
        loss = model(*example_inputs(model.cfg), labels=example_inputs(model.cfg)[0])
    """
    opts = BoostOptions.parse(options)
    _refuse_parallelized(model)
    group = resolve_group(tp_mesh)
    graphs = capture(
        model, tuple(example_inputs), example_kwargs,
        refuse_parameter_writes=True, require_compiled=True,
    )  # fmt: skip

    plan = TPPlan(p=group.size, group=group.name)
    for g in graphs:
        # The same passes the backend runs by default, so the plan lists the
        # collectives a default torch.compile(backend="boost") executes.
        ctx = PassContext(g.param_names, tp=group, fixed=dict(plan.params))
        for cls in FRONT:
            cls(ctx)(g.gm.graph)
        bottlenecks = ctx.bottlenecks = find_bottlenecks(g.gm, g.param_names)
        for cls in TP_PASSES:
            if opts.enabled(cls.name):
                cls(ctx, opts.passes[cls.name])(g.gm.graph)
        result = ctx.notes["btp"]
        plan.params.update(result.params)
        plan.bottlenecks += bottlenecks
        plan.collectives += result.collectives
        plan.fallbacks += result.fallbacks
        plan.decisions += result.decisions
    # Every check above ran on the captured copy: nothing was modified before here.
    _shard_in_place(model, plan, group, dict(options or {}))
    model.forward.expect(  # type: ignore[attr-defined]
        model.training,
        frozenset((example_kwargs or {}).keys()),
        frozenset(fqn for g in graphs for fqn in g.param_names.values()),
    )
    synchronise_rng(group)
    log.info(
        "parallelized %s over tp=%d: %d bottleneck(s), %d sharded parameter(s)",
        type(model).__name__,
        group.size,
        len(plan.bottlenecks),
        sum(pl.is_shard for pl in plan.params.values()),
    )
    model.boost_plan = plan  # type: ignore[assignment]
    return model


def _refuse_parallelized(model: nn.Module) -> None:
    """A second ``parallelize`` would shard the shards (and trace the NaN placeholders)."""
    if isinstance(model.__dict__.get("forward"), _ShadowForward):
        raise AlreadyParallelizedError(
            f"{type(model).__name__} is already parallelized (its plan is model.boost_plan); "
            "call parallelize once per model, on the single-device model"
        )
    for name, prm in model.named_parameters():
        if getattr(prm, "_boost_shard", False):
            raise AlreadyParallelizedError(
                f"parameter {name!r} of {type(model).__name__} is already a tensor-parallel "
                "shard: a part of a parallelized model cannot be parallelized again"
            )


def _shard_in_place(
    model: nn.Module, plan: TPPlan, group: TPGroup, options: dict[str, Any]
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
    for key, prm in params.items():
        fqn = first_name[key]
        placement = plan.params.setdefault(fqn, R)
        plan.param_shapes[fqn] = tuple(prm.shape)
        local = nn.Parameter(local_shard(prm, placement, group), prm.requires_grad)
        local._boost_shard = True  # type: ignore[attr-defined]
        placeholder = nn.Parameter(
            torch.full((), float("nan"), dtype=prm.dtype, device=prm.device).expand(prm.shape),
            prm.requires_grad,
        )
        placeholder._boost_local = local  # type: ignore[attr-defined]
        placeholder._boost_owner = owners[key][0]  # type: ignore[attr-defined]
        placeholder._boost_fqn = fqn  # type: ignore[attr-defined]
        placeholder._boost_placement = placement  # type: ignore[attr-defined]
        placeholder._boost_group = group  # type: ignore[attr-defined]
        memo[key] = placeholder
        params[key] = local
    shadow = copy.deepcopy(model, memo)
    for key, local in params.items():
        for mod, name in owners[key]:
            mod._parameters[name] = local

    model.forward = _ShadowForward(shadow, options)  # type: ignore[method-assign]
    train, apply = model.train, model._apply

    def train_both(mode: bool = True) -> nn.Module:
        shadow.train(mode)
        return train(mode)

    def apply_both(fn: Any, recurse: bool = True) -> nn.Module:
        out = apply(fn, recurse)
        _follow(shadow, model)
        return out

    model.train = train_both  # type: ignore[method-assign]
    # to(), to_empty(), half(), cuda() all go through _apply: the shadow follows.
    model._apply = apply_both  # type: ignore[method-assign]


def _follow(shadow: nn.Module, model: nn.Module) -> None:
    """Give the shadow the model's buffers, and placeholders on the shards' device and dtype.

    How a model parallelized on the meta device becomes a real one: after
    ``model.to_empty(device=...)`` the shards are real, so the placeholders the
    shadow traces with move to their device (a graph would otherwise mix meta
    and real tensors), and buffers (replaced by ``_apply``) are shared again.
    """
    originals = dict(model.named_modules(remove_duplicate=False))
    moved: dict[int, nn.Parameter] = {}  # tied parameters stay one placeholder
    for name, smod in shadow.named_modules(remove_duplicate=False):
        mod = originals.get(name)
        if mod is None:
            continue
        smod._buffers.update(mod._buffers)
        for pname, ph in list(smod._parameters.items()):
            if ph is None or not hasattr(ph, "_boost_local"):
                continue
            local = current_local(ph)
            if (ph.device, ph.dtype) == (local.device, local.dtype):
                continue
            if id(ph) not in moved:
                new = nn.Parameter(
                    torch.full((), float("nan"), dtype=local.dtype, device=local.device).expand(
                        ph.shape
                    ),
                    ph.requires_grad,
                )
                new.__dict__.update(
                    {k: v for k, v in ph.__dict__.items() if k.startswith("_boost")}
                )
                moved[id(ph)] = new
            smod._parameters[pname] = moved[id(ph)]


# The parameters the compiled graphs of the current forward call ran with (by name).
SUBSTITUTED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "boost_substituted", default=None
)


# The least recompile limit a parallelized forward's frames get (see _ShadowForward).
SHADOW_RECOMPILE_LIMIT = 256


class _ShadowForward:
    """The parallelized model's forward: the shadow, through the boost backend.

    A frame of the shadow that dynamo gives up on (``recompile_limit``: HF
    forwards share wrapper code objects between models, and every new shape,
    backend or instance adds a cache entry) would by dynamo's default run as
    plain Python, on the NaN placeholders: NaN or silently missing gradients.
    ``fail_on_recompile_limit_hit`` turns that into dynamo's own error naming the
    frame, and it is set only while this forward runs, so models that were
    never parallelized keep dynamo's default. That needs a frame of ours that
    runs as Python even under the user's ``torch.compile(model)``:
    ``__call__`` is skipped by dynamo's frame evaluation (``skip_code``: its own
    frame only), and :meth:`_enter`, called with the flag set, is the frame
    dynamo compiles. When the user's compiled code calls the model (a compiled
    train step), dynamo inlines ``__call__`` and the shadow is traced into that
    graph; frames past a graph break inside the model then follow the
    process's own setting (see README, "Recompile limit").
    """

    def __init__(self, shadow: nn.Module, options: dict[str, Any]) -> None:
        from ..backend import boost_backend

        self.shadow = shadow
        backend = functools.partial(boost_backend, options={**options, "lowering": "eager"})
        self.eager = torch.compile(shadow, backend=backend, dynamic=False)

    def expect(self, training: bool, kwargs: frozenset[str], used: frozenset[str]) -> None:
        """The parameters graphs must compute with in a call like parallelize's example."""
        self.expected = (training, kwargs, used)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # inlined into the user's traced code
            return self.shadow(*args, **kwargs)
        seen: set[str] = set()
        token = SUBSTITUTED.set(seen)
        cfg = torch._dynamo.config
        try:
            # Raised limits, for both routes (our eager compile and the user's
            # torch.compile): each frame of the shadow is compiled once per module
            # instance, and one that passes the limit can only fail, never fall back.
            with cfg.patch(
                fail_on_recompile_limit_hit=True,
                recompile_limit=max(cfg.recompile_limit, SHADOW_RECOMPILE_LIMIT),
                accumulated_recompile_limit=max(
                    cfg.accumulated_recompile_limit, 16 * SHADOW_RECOMPILE_LIMIT
                ),
            ):
                out = self._enter(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise UncompiledFrameError(
                "a frame of the parallelized model passed dynamo's recompile limit "
                f"({max(cfg.recompile_limit, SHADOW_RECOMPILE_LIMIT)}); run as Python it would compute on "
                "placeholders, not on this rank's shards. Raise "
                "torch._dynamo.config.recompile_limit, or reduce the frames dynamo must "
                "compile (graph breaks inside a loop over modules: TORCH_LOGS=recompiles)"
            ) from exc
        finally:
            SUBSTITUTED.reset(token)
        self._check_compiled(seen, frozenset(kwargs))
        return out

    def _check_compiled(self, seen: set[str], kwargs: frozenset[str]) -> None:
        """Every parameter the example call used must have reached a compiled graph.

        One that did not was read by code dynamo left to plain Python (a frame it
        skipped, with everything it calls, e.g. after a graph break inside a loop
        over modules): that code computed on the NaN placeholders. Checked for calls
        like parallelize's example (train/eval mode and keyword names), whose
        parameters are known; other calls may rightly use fewer.
        """
        training, example_kwargs, used = getattr(self, "expected", (None, None, frozenset()))
        if (self.shadow.training, kwargs) != (training, example_kwargs):
            return
        missing = sorted(used - seen)
        if missing:
            raise UncompiledFrameError(
                f"parameters {missing[:4]}{'...' if len(missing) > 4 else ''} of a parallelized "
                "model were read outside the compiled graphs (dynamo left their frame to "
                "Python, e.g. after a graph break inside a loop over modules): that part "
                "computed on placeholders, not on this rank's shards. Remove the graph break "
                "(TORCH_LOGS=graph_breaks shows where), or move it out of the loop"
            )

    def _enter(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            # The top frame of the user's torch.compile(model, backend="boost"): trace
            # the shadow; the outer backend sees the placeholders and applies the rewrite.
            return self.shadow(*args, **kwargs)
        # Called eagerly: our own compile. Each new input shape recompiles (static
        # shapes keep the rewrite simple), hence the higher limits set by __call__.
        return self.eager(*args, **kwargs)


torch._dynamo.eval_frame.skip_code(_ShadowForward.__call__.__code__)
