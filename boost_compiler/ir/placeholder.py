"""The shadow's parameters: global-shape placeholders that compute only inside a boost graph.

A parallelized model's shadow (see :mod:`boost_compiler.parallel.shadow`) holds, in place of each parameter, a
:class:`Placeholder` with the parameter's global shape, which dynamo traces with and the
boost backend swaps for the owner's current shard at every call. That a placeholder never
computes anywhere else is the placeholder's own property, not an inference from what dynamo
reported compiling: every ATen operation on a real placeholder raises
:class:`~boost_compiler.errors.UncompiledFrameError`, naming the parameter, its module and
the line of code that ran. So a frame dynamo runs as plain Python, whatever compiled that
code earlier in the process (a ``detect``, a ``torch.compile`` of the class, a second
instance, a frame past the recompile limit, ``torch.compiler.disable``), raises instead of
computing on the placeholder.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..errors import UncompiledFrameError

# The one attribute the shadow contract puts on a placeholder (and on a model or a shard).
ATTR = "_boost"


@dataclass(frozen=True, eq=False)
class ShadowParam:
    """What the boost backend needs about one placeholder of the shadow.

    ``owner`` is the module of the model holding the shard, and the shard's name
    there; ``local`` is the shard ``parallelize`` made, used only while the owner
    holds none (see :func:`current_local`); ``plan`` is the model's plan, which
    records every graph the backend rewrites for it.

    ``placement``, ``group`` and ``plan`` are a :class:`~boost_compiler.tp.placement.Placement`,
    a :class:`~boost_compiler.tp.groups.TPGroup` and a :class:`~boost_compiler.tp.plan.TPPlan`,
    typed ``Any`` here because ``ir`` sits below ``tp`` (``tp`` reads the IR; the IR never
    imports ``tp``, even for types).
    """

    fqn: str
    placement: Any
    group: Any
    owner: tuple[nn.Module, str]
    local: nn.Parameter
    plan: Any


class Placeholder(torch.Tensor):
    """A shadow parameter: dynamo traces it as a plain parameter, eager dispatch refuses it.

    A traceable wrapper subclass (``__tensor_flatten__``) around a stride-0 NaN
    tensor: dynamo fakifies it through its inner tensor, which ``__tensor_unflatten__``
    gives a contiguous parameter's strides, and records the same graph a plain
    parameter gives (checked on 2.13); every ATen operation on it
    reaches :meth:`__torch_dispatch__`, which computes only on fake inner
    tensors, i.e. while dynamo traces, and raises for real ones. Metadata
    (sizes, strides, dtype, device) lives on the wrapper and dispatches nothing.
    ``_is_param`` makes it an ``nn.Parameter`` for ``isinstance``, as FSDP2's
    DTensor parameters are, so dynamo and ``nn.Module`` treat it as one.
    """

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> Placeholder:
        # The wrapper has the strides of a contiguous parameter of this shape, whatever
        # ``elem``'s (stride 0): metadata only, it owns no storage.
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.shape, strides=make_contiguous_strides_for(elem.shape), storage_offset=0,
            dtype=elem.dtype, device=elem.device, requires_grad=requires_grad,
        )  # fmt: skip
        t.elem = elem
        t._is_param = True
        return t

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Any], meta: Any, size: Any, stride: Any) -> Any:
        elem = inner["elem"]
        if isinstance(elem, FakeTensor) and elem.stride() != tuple(stride):
            # Dynamo's fake copy of the stride-0 NaN: traced ops must see the strides a
            # real parameter has, or the graph differs from a plain parameter's and
            # stride checks refuse it (``torch._grouped_mm``'s meta rejects a stride-0
            # ``mat_b``: bf16 MoE experts). A fake tensor allocates nothing.
            elem = elem.new_empty_strided(size, stride)
        return Placeholder(elem)

    def __repr__(self) -> str:  # the default repr would compute on it
        record = shadow_param(self)
        return f"Placeholder({record.fqn if record else '?'}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        held = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Placeholder)]
        if not all(isinstance(a.elem, FakeTensor) for a in held):
            raise _uncompiled(func, held)
        args, kwargs = pytree.tree_map_only(Placeholder, lambda a: a.elem, (args, kwargs or {}))
        return func(*args, **kwargs)


def _uncompiled(func: Any, placeholders: list[Any]) -> UncompiledFrameError:
    records = [r for p in placeholders if (r := shadow_param(p)) is not None]
    names = [r.fqn for r in records] or ["?"]
    owner = records[0].owner[0] if records else None
    module = names[0].rpartition(".")[0] or "<the model>"
    where = _user_line()
    return UncompiledFrameError(
        f"{func} on parameter {names[0]!r} (module {module!r}, "
        f"{type(owner).__name__ if owner is not None else '?'}) of a parallelized model ran "
        f"as plain Python at {where}, outside every compiled graph: it would compute on a "
        "placeholder, not on this rank's shard. Dynamo runs that frame uncompiled: a graph "
        "break it cannot resume from (e.g. a logging or warning call inside a loop over "
        "modules; TORCH_LOGS=graph_breaks shows where), remembered from any earlier compile "
        "of this code in the process, or torch.compiler.disable. Remove the break, or move "
        "it out of the loop; torch._dynamo.reset() forgets what dynamo skipped before"
    )


def _user_line() -> str:
    """The innermost frame of the caller's code: neither torch's nor this package's."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame: Any = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(skip) and "<frozen" not in path:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown line"


def make_placeholder(
    info: ShadowParam, like: torch.Tensor, shape: torch.Size, dtype: torch.dtype | None = None
) -> nn.Parameter:
    """A global-``shape`` :class:`Placeholder` with ``like``'s dtype (or ``dtype``), device
    and ``requires_grad``.

    Stride 0, so it holds one element whatever its shape; NaN, so that even a
    computation that slipped past the override could not produce numbers.
    """
    nan = torch.full((), float("nan"), dtype=dtype or like.dtype, device=like.device)
    placeholder = Placeholder(nan.expand(shape), like.requires_grad)
    setattr(placeholder, ATTR, info)
    return placeholder  # type: ignore[return-value]  # an nn.Parameter by _is_param


def shadow_param(t: Any) -> ShadowParam | None:
    """The record of a shadow placeholder; None for any other value."""
    info = getattr(t, ATTR, None)
    return info if isinstance(info, ShadowParam) else None


def placeholder_record(t: Any) -> ShadowParam:
    """The record of ``t``, which must be a shadow placeholder."""
    info = shadow_param(t)
    if info is None:
        raise TypeError(f"not a placeholder of a parallelized model's shadow: {type(t).__name__}")
    return info


def current_local(placeholder: torch.Tensor) -> torch.Tensor:
    """The tensor the owning module holds for this placeholder's parameter now.

    Looked up at every call, not fixed at ``parallelize`` time, so whatever
    replaces the module's parameter is what runs: ``load_state_dict(assign=True)``,
    or FSDP2, which swaps in the all-gathered parameter for the forward.
    """
    info = placeholder_record(placeholder)
    mod, name = info.owner
    current = mod._parameters.get(name)
    return info.local if current is None else current
