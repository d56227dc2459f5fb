"""The shadow contract: what ``parallelize`` leaves on a model, and how its methods keep the shadow in step.

A parallelized model keeps its module tree, with this rank's shards as parameters (what
the optimizer trains and ``state_dict`` returns); its forward runs the *shadow*, a copy of
that tree taken by ``parallelize`` whose parameters are placeholders (:mod:`boost_compiler.ir.placeholder`)
with the global shapes, compiled through the boost backend, which swaps each placeholder for its
owner's current shard at every call. Everything that ties the two together lives here,
one dataclass per object under the one attribute ``_boost``: the model's
:class:`ParallelState` (read with :func:`parallel_state`), each placeholder's
:class:`ShadowParam` (:func:`shadow_param`), each shard's :class:`Shard` mark
(:func:`is_shard`). Of the model's ``nn.Module`` methods, ``forward`` is the shadow's;
``train``/``eval``, ``requires_grad_``, ``load_state_dict`` and everything built on
``_apply`` (``to``, ``half``, ``bfloat16``, ``float``, ``double``, ``cuda``, ``to_empty``),
called on the model or on any module inside it, change the shards and then bring the
shadow into step (modes, placeholders' dtype, device and ``requires_grad``, shared
buffers); a hook registered on an inner module after ``parallelize`` could never run and
raises :class:`~boost_compiler.errors.HookAfterParallelizeError`; hooks on the model
itself run as on any module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._dynamo_compat import tracing_patches
from ..errors import HookAfterParallelizeError, ParallelModelCopyError, UncompiledFrameError
from ..ir.placeholder import (
    ATTR,
    ShadowParam,
    current_local,
    make_placeholder,
    shadow_param,
)
from .agreement import agree, input_signature

if TYPE_CHECKING:
    from ..tp.groups import TPGroup
    from ..tp.plan import TPPlan


# The methods that change what the shadow must copy: each syncs it after it ran.
_MIRRORED = ("_apply", "train", "requires_grad_", "load_state_dict")
# Registering these on an inner module of a parallelized model raises: it never runs.
_HOOK_METHODS = (
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
)
# The hook tables of the shadow's root, emptied: the model's own __call__ runs them.
_CALL_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


@dataclass(frozen=True)
class Shard:
    """The mark of a parameter ``parallelize`` made: this rank's shard of ``fqn``."""

    fqn: str


@dataclass(eq=False)
class ParallelState:
    """Everything ``parallelize`` attached to a model: read it with :func:`parallel_state`.

    ``pairs`` are (module of the model, its copy in the shadow), each module once;
    ``params`` the placeholders' records by parameter name; ``plan`` is also
    ``model.boost_plan``.
    """

    shadow: nn.Module
    forward: ShadowForward
    plan: TPPlan
    group: TPGroup
    options: dict[str, Any]
    params: dict[str, ShadowParam]
    pairs: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)
    # Inside a mirrored method call, whose outermost frame brings the shadow into step.
    busy: bool = False
    # The dtype the floating placeholders trace in when it is not the shards' own: FSDP2's
    # MixedPrecisionPolicy keeps fp32 shards and hands the forward bf16 (set_compute_dtype).
    compute_dtype: torch.dtype | None = None


def parallel_state(model: nn.Module) -> ParallelState | None:
    """The state ``parallelize`` attached to ``model``; None for a model it did not parallelize.

    Also through a ``torch.compile(model)`` wrapper, which keeps the model as ``_orig_mod``.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    state = model.__dict__.get(ATTR)
    return state if isinstance(state, ParallelState) else None


def is_shard(t: Any) -> bool:
    """Whether ``t`` is a parameter ``parallelize`` made (a rank's shard)."""
    return isinstance(getattr(t, ATTR, None), Shard)


def mark_shard(t: nn.Parameter, fqn: str) -> nn.Parameter:
    setattr(t, ATTR, Shard(fqn))
    return t


def attach(model: nn.Module, state: ParallelState) -> None:
    """Make ``model`` run ``state.shadow`` and keep it in step (see the module docstring).

    The methods are instance attributes of every module of the model (not of the
    shadow): ``nn.Module`` recurses through ``module.train(mode)`` and
    ``module._apply(fn)``, so a call anywhere in the tree passes through them, and
    only the outermost one syncs the shadow, once, after the class's own method ran.
    """
    shadow_modules = dict(state.shadow.named_modules(remove_duplicate=False))
    state.pairs = [(mod, shadow_modules[name]) for name, mod in model.named_modules()]
    for table in _CALL_HOOKS:
        getattr(state.shadow, table).clear()  # the shadow's copies of the model's hooks
    model.__dict__[ATTR] = state
    model.forward = state.forward  # type: ignore[method-assign]
    # pickle and copy look __reduce_ex__ up on the instance: torch.save(model) and
    # deepcopy(model) get a named error, not "Can't pickle local object" or a copy
    # whose mirrored methods still act on this model's shadow.
    model.__dict__["__reduce_ex__"] = _refuse_copy
    for name, mod in model.named_modules():
        for method in _MIRRORED:
            setattr(mod, method, functools.partial(_mirrored, method, mod, state))
        if mod is not model:
            for method in _HOOK_METHODS:
                setattr(mod, method, functools.partial(_refuse_hook, name, method))


def _mirrored(method: str, mod: nn.Module, state: ParallelState, *args: Any, **kwargs: Any) -> Any:
    """``type(mod).<method>``, then, for the outermost call, the shadow brought into step."""
    run = getattr(type(mod), method)
    if state.busy:  # a child's part of a call on an ancestor: the ancestor syncs
        return run(mod, *args, **kwargs)
    state.busy = True
    try:
        return run(mod, *args, **kwargs)
    finally:
        state.busy = False
        follow(state)


def follow(state: ParallelState) -> None:
    """Give the shadow the model's modes and buffers, and placeholders like the shards.

    A placeholder whose shard changed dtype, device or ``requires_grad`` (``half()``,
    ``to_empty(device=...)`` of a model parallelized on the meta device, an
    unfrozen parameter) is replaced by one that matches: dynamo traces the shadow,
    so its placeholders decide the dtypes the graphs compute in, and whether they
    compute a parameter's gradient. Buffers, which ``_apply`` replaces, are shared
    again. The new placeholders fail dynamo's guards: the next call recompiles.
    """
    moved: dict[int, nn.Parameter] = {}  # tied parameters stay one placeholder
    for mod, smod in state.pairs:
        smod.training = mod.training
        smod._buffers.update(mod._buffers)
        for pname, ph in list(smod._parameters.items()):
            info = shadow_param(ph)
            if info is None:
                continue
            local = current_local(ph)
            dtype = local.dtype
            if state.compute_dtype is not None and local.is_floating_point():
                dtype = state.compute_dtype
            if (ph.device, ph.dtype, ph.requires_grad) == (
                local.device, dtype, local.requires_grad,
            ):  # fmt: skip
                continue
            if id(ph) not in moved:
                moved[id(ph)] = make_placeholder(info, local, ph.shape, dtype)
            smod._parameters[pname] = moved[id(ph)]


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Trace the shadow's floating placeholders in ``dtype`` whatever the shards' dtype.

    For a wrapper that computes in another dtype than it stores: FSDP2 with
    ``MixedPrecisionPolicy(param_dtype=bf16)`` keeps fp32 shards on the model and puts
    bf16 all-gathered ones there for each forward, which the graph must have been traced
    for (dynamo traces the placeholders). ``None``: the shards' own dtype again.
    """
    state = parallel_state(model)
    if state is None:
        raise TypeError(f"{type(model).__name__} was not parallelized")
    state.compute_dtype = dtype
    follow(state)


def _refuse_copy(*args: Any) -> Any:
    raise ParallelModelCopyError(
        "a parallelized model cannot be pickled or deep-copied (torch.save(model), "
        "copy.deepcopy): it holds this rank's shards and a compiled shadow. Save "
        "boost_compiler.gather_state_dict(model) (a single-device state dict, any layout) "
        "or a torch.distributed.checkpoint of its state_dict(); to copy, build a new model "
        "and parallelize it"
    )


def _refuse_hook(name: str, method: str, *args: Any, **kwargs: Any) -> Any:
    raise HookAfterParallelizeError(
        f"{method} on {name!r}, an inner module of a parallelized model: the hook would "
        "never run, since the model's forward runs the shadow, a copy of the module tree "
        "taken by parallelize. Register it before parallelize (it is then traced into the "
        "compiled graphs, on global shapes), or on the parallelized model itself"
    )


# The least recompile limit a parallelized forward's frames get (see ShadowForward).
SHADOW_RECOMPILE_LIMIT = 256


@torch.compiler.disable  # plain Python even under the user's torch.compile(model)
def _agree_on_inputs(group: TPGroup, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    agree(group, "the first call of the parallelized model",
          {"input shapes": input_signature(args, kwargs)})  # fmt: skip


class ShadowForward:
    """The parallelized model's forward: the shadow, through the boost backend.

    A frame of the shadow that dynamo gives up on (``recompile_limit``: HF
    forwards share wrapper code objects between models, and every new shape,
    backend or instance adds a cache entry) would by dynamo's default run as
    plain Python, where the placeholders refuse to compute (:mod:`boost_compiler.ir.placeholder`).
    ``fail_on_recompile_limit_hit`` turns that into dynamo's own error naming the
    limit, earlier, and it is set only while this forward runs, so models that were
    never parallelized keep dynamo's default. That needs a frame of ours that
    runs as Python even under the user's ``torch.compile(model)``:
    ``__call__`` is skipped by dynamo's frame evaluation (``skip_code``: its own
    frame only), and :meth:`_enter`, called with the flag set, is the frame
    dynamo compiles. When the user's compiled code calls the model (a compiled
    train step), dynamo inlines ``__call__`` and the shadow is traced into that
    graph; frames past a graph break inside the model then follow the
    process's own setting (see README, "Recompile limit").

    ``backend`` compiles the shadow when the forward is called eagerly (the boost
    backend with eager lowering, given by ``parallelize``).
    """

    def __init__(
        self, shadow: nn.Module, backend: Callable[..., Any], group: TPGroup | None = None
    ) -> None:
        self.shadow = shadow
        self.eager = torch.compile(shadow, backend=backend, dynamic=False)
        self.group = group  # the first call's shapes are compared over it (parallel/agreement.py)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # inlined into the user's traced code
            return self.shadow(*args, **kwargs)
        if self.group is not None:  # ranks called with other shapes would wait on each other
            group, self.group = self.group, None
            _agree_on_inputs(group, args, kwargs)
        cfg = torch._dynamo.config
        try:
            # Raised limits, for both routes (our eager compile and the user's
            # torch.compile): each frame of the shadow is compiled once per module
            # instance, and one that passes the limit can only fail, never fall back.
            # specialize_float: under dynamic shapes dynamo makes a module's float
            # attribute (a norm's eps) a tensor, and its tensorify pass turns that back
            # into a float in the top graph only; a nested compile region's body
            # (``compile_blocks``) kept ``eps.item()`` on what arrives as a float.
            # tracing_patches: gradient-checkpointed HF models trace with the `kernels`
            # package's side effect in their forwards (boost_compiler/_dynamo_compat.py).
            with cfg.patch(
                **tracing_patches(),
                specialize_float=True,
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
        return out

    def _enter(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            # The top frame of the user's torch.compile(model, backend="boost"): trace
            # the shadow; the outer backend sees the placeholders and applies the rewrite.
            return self.shadow(*args, **kwargs)
        # Called eagerly: our own compile. Each new input shape recompiles (static
        # shapes keep the rewrite simple), hence the higher limits set by __call__.
        return self.eager(*args, **kwargs)


torch._dynamo.eval_frame.skip_code(ShadowForward.__call__.__code__)
