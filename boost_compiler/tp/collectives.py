"""Tensor-parallel communication primitives, and the one table of what each communicates.

Invariant: every collective the compiler puts into a graph is a call of a
primitive registered in :data:`COMMUNICATION` (below, or in ``kernels.py``),
whose rows give the kind, direction (forward, backward) and payload of each
collective one call performs; :func:`graph_collectives` reads a graph's
collectives off its nodes through that table, so the graph is their only
record. Each primitive takes a tensor and a process-group *name* (a ``str``:
a literal for dynamo, ``make_fx`` and Inductor alike, so one FX node runs
eagerly and compiled) and gives exact values and gradients under Megatron's
conventions (see "autograd functions").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx

from ..ir.ops import value_of

__all__ = [
    "COMMUNICATION",
    "Collective",
    "Comm",
    "all_reduce_sum",
    "communicates",
    "copy_to_tp",
    "fake_process_group",
    "forward_communicating",
    "gather_from_tp",
    "graph_collectives",
    "group_name_of",
    "reduce_from_tp",
    "scatter_to_tp",
]

_c10d = torch.ops._c10d_functional


# ----------------------------------------------------------------------------
# group helpers
# ----------------------------------------------------------------------------


def group_name_of(group: object = None) -> str:
    """The name string of a ProcessGroup, a 1-D DeviceMesh, or ``None`` (the world).

    A ``str`` is returned unchanged. For a ProcessGroup this is ``pg.group_name``;
    for a 1-D DeviceMesh it is ``mesh.get_group().group_name`` (equal to
    ``mesh._dim_group_names[0]``).
    """
    if isinstance(group, str):
        return group
    if group is None:
        return dist.group.WORLD.group_name  # type: ignore[union-attr]
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group_name_of needs a 1-D DeviceMesh, got {group.ndim}-D")
        return group.get_group().group_name
    raise TypeError(f"cannot derive a process-group name from {type(group).__name__}")


@torch.compiler.assume_constant_result
def _group_rank(group: str) -> int:
    # assume_constant_result: dynamo calls this at trace time and bakes the int in
    # (it cannot trace _resolve_process_group on a string itself).
    return dist.distributed_c10d._resolve_process_group(group).rank()


@torch.compiler.assume_constant_result
def _group_size(group: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group).size()


def _rank_and_size(group: str, rank: int | None, world_size: int | None) -> tuple[int, int]:
    actual = (_group_rank(group), _group_size(group))
    if (rank, world_size) != (None, None) and (rank, world_size) != actual:
        raise ValueError(
            f"group {group!r}: this process is rank {actual[0]} of {actual[1]}, "
            f"the graph was built for rank={rank}, world_size={world_size}"
        )
    return actual


# ----------------------------------------------------------------------------
# raw collectives (no autograd semantics of their own are relied upon)
# ----------------------------------------------------------------------------


def _raw_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))


def _raw_all_gather(x: torch.Tensor, dim: int, group: str, world: int) -> torch.Tensor:
    """All-gather along ``dim`` with the shards in rank order.

    ``all_gather_into_tensor`` stacks along dim 0; for another dim the result is
    split back into the ``world`` rank blocks and concatenated along ``dim``.
    """
    dim = dim % x.dim()
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), world, group))
    if dim == 0:
        return out
    return torch.cat(torch.chunk(out, world, dim=0), dim=dim)


def _local_slice(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = x.size(dim)
    # torch._check instead of `if`: no guard / graph break on a symbolic size.
    torch._check(size % world == 0, lambda: f"dim {dim} ({size}) not divisible by {world}")
    shard = size // world
    return x.narrow(dim, rank * shard, shard)


# ----------------------------------------------------------------------------
# autograd functions
# ----------------------------------------------------------------------------
# The communication is written with the raw functional collectives (all_reduce /
# all_gather_into_tensor, then wait_tensor). AOTAutograd executes a custom
# autograd.Function on fake tensors, so its forward and backward graphs hold
# the collectives as ordinary _c10d_functional nodes (no opaque custom op, no
# higher-order op), which Inductor lowers like any other (in-place all_reduce_
# on a buffer, bucketing, reordering).
#
# Why autograd.Function (measured on torch 2.13, CPU, gloo and fake group):
# * the detach trick for g (ar(x.detach()) + (x - x.detach())) also gives plain
#   nodes, but leaves detach, sub, add in the forward graph and turns an inf in
#   x into nan; f has no such trick without a forward collective.
# * torch.library.custom_op + register_autograd shows a named, opaque node in
#   the forward graph (the collective hidden inside it) and forces a copy for
#   f, whose output may not alias its input.
# * user code calling a primitive under torch.compile gets a
#   higher_order.autograd_function_apply node in the dynamo graph; AOT inlines
#   it, but AOTAutograd's cache is bypassed for such graphs. Nodes inserted by
#   the compiler see none of this.
#
# Gradient conventions (Megatron): a tensor is either replicated (every rank
# holds the same value and computes the same thing from it) or rank-varying
# (sharded or a partial sum). The loss is replicated, so the gradient of a
# replicated tensor is the same on every rank and must not be summed again.
#
# Pitfall: in torch 2.13 _c10d_functional.all_reduce carries an autograd
# formula whose backward is another all-reduce, and all_gather_into_tensor's
# backward is a reduce-scatter. Those are right only when the consumer is
# rank-varying; for Megatron's g (replicated consumer) they multiply gradients
# by the world size. Hence these functions.


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> torch.Tensor:
        return _raw_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _raw_all_reduce(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str, rank: int, world: int):
        ctx.dim, ctx.rank, ctx.world = dim, rank, world
        return _raw_all_gather(x, dim, group, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _local_slice(grad, ctx.dim, ctx.rank, ctx.world), None, None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str, rank: int, world: int):
        ctx.dim, ctx.group, ctx.world = dim, group, world
        return _local_slice(x, dim, rank, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _raw_all_gather(grad, ctx.dim, ctx.group, ctx.world), None, None, None, None


# ----------------------------------------------------------------------------
# the table: what each primitive communicates, read off a graph
# ----------------------------------------------------------------------------

#: ``(global shape, dtype)`` of one collective's payload at a node, or None when
#: the node does not communicate after all (a scatter of a tensor without grad).
Payload = Callable[[fx.Node], "tuple[tuple[Any, ...], torch.dtype] | None"]


@dataclass(frozen=True)
class Collective:
    """One collective a graph performs per call, for the plan, the cost model and explain.

    The payload (``global_shape``, ``dtype``) is the reduced or gathered tensor at
    its global size: the cost model's convention.
    """

    kind: str  # "all_reduce" | "all_gather"
    node: str
    global_shape: tuple[Any, ...]
    dtype: torch.dtype
    forward: bool  # communicates in the forward
    backward: bool  # communicates in the backward
    reason: str = ""


@dataclass(frozen=True)
class Comm:
    """One row of :data:`COMMUNICATION`: a collective each call of a primitive performs."""

    kind: str
    forward: bool
    backward: bool
    payload: Payload
    reason: str


#: Every primitive that communicates -> the collectives one call performs. Rows are
#: added by :func:`communicates`, beside the primitive they describe (here and in
#: ``kernels.py``); a graph's collectives are whatever its nodes call from here.
COMMUNICATION: dict[Callable[..., Any], tuple[Comm, ...]] = {}

#: ``node.meta`` key a pass may set on a node it inserts to say why it communicates
#: (e.g. "vocab head"); the row's reason otherwise.
WHY_META = "boost_why"

_F = TypeVar("_F", bound=Callable[..., Any])


def communicates(*rows: Comm) -> Callable[[_F], _F]:
    """Register ``rows`` as what each call of the decorated primitive communicates.

    Registration happens when the primitive's module is imported, which is before
    any graph can call it: a table lookup never misses a primitive a node targets.
    """

    def register(fn: _F) -> _F:
        COMMUNICATION[fn] = rows
        return fn

    return register


def graph_collectives(graph: fx.Graph) -> list[Collective]:
    """The collectives ``graph`` performs per call, in node order: the only record of them.

    A primitive with a backward collective counts in both directions (one
    :class:`Collective` per row of :data:`COMMUNICATION`).
    """
    found = []
    for node in graph.nodes:
        rows = COMMUNICATION.get(node.target, ()) if node.op == "call_function" else ()
        for row in rows:
            payload = row.payload(node)
            if payload is None:
                continue
            shape, dtype = payload
            why = node.meta.get(WHY_META) or row.reason
            found.append(
                Collective(row.kind, node.name, shape, dtype, row.forward, row.backward, why)
            )
    return found


def forward_communicating(node: fx.Node) -> bool:
    """Whether ``node`` calls a primitive that communicates in its forward."""
    rows = COMMUNICATION.get(node.target, ()) if node.op == "call_function" else ()
    return any(row.forward for row in rows)


def _payload_of(value: Any) -> tuple[tuple[Any, ...], torch.dtype] | None:
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def input_payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
    """The first argument's value: what an all-reduce sums."""
    return _payload_of(value_of(node.args[0]) if node.args else None)


def output_payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
    """The node's own value (a gather's result; a reduced sum)."""
    return _payload_of(value_of(node))


def _grad_payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
    # A scatter is a slice; only a gradient flowing back makes it gather.
    v = value_of(node.args[0]) if node.args else None
    return _payload_of(v) if isinstance(v, torch.Tensor) and v.requires_grad else None


def statistics_payload(x_arg: int, width: Callable[[fx.Node], int]) -> Payload:
    """fp32 ``[..., width]`` per token of argument ``x_arg`` (kernels reduce statistics
    in fp32 whatever the activations' dtype)."""

    def payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
        v = value_of(node.args[x_arg])
        if not isinstance(v, torch.Tensor):
            return None
        return (*v.shape[:-1], width(node)), torch.float32

    return payload


# ----------------------------------------------------------------------------
# public primitives
# ----------------------------------------------------------------------------


@communicates(Comm("all_reduce", True, False, input_payload, "row-parallel"))
def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's g: forward all-reduce SUM over ``group``, backward identity.

    Use where rank-varying partial sums (output of a row-parallel matmul) become
    a replicated tensor. Exact: ``y = sum_r x_r`` is consumed identically on every
    rank, so the replicated loss gives the same ``dL/dy`` everywhere and
    ``dL/dx_r = dL/dy``; summing it again would scale by the world size (which
    is what funcol's own autograd formula does).
    """
    return _ReduceFromTP.apply(x, group)


@communicates(Comm("all_reduce", False, True, input_payload, "f"))
def copy_to_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's f: forward identity, backward all-reduce SUM of the gradient.

    Use where a replicated tensor enters rank-varying computation (input of a
    column-parallel matmul). Exact: every rank's shard of the computation
    contributes a partial ``dL/dx``; the true gradient of the replicated ``x`` is
    their sum, and it is again replicated after the all-reduce.
    """
    return _CopyToTP.apply(x, group)


@communicates(Comm("all_reduce", True, True, input_payload, "all-reduce"))
def all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward all-reduce SUM, backward all-reduce SUM of the gradient.

    For sums whose result feeds *rank-varying* computation (e.g. the fused
    ``[H, S]`` statistics of online RMSNorm when ``S`` scales a sharded tensor):
    ``y = sum_r x_r`` and each rank's loss term depends on ``y`` through its own
    shard, so ``dL/dx_r = sum_s dL_s/dy`` = all-reduce of the gradient. This is
    exactly the autograd formula torch 2.13 registers on
    ``_c10d_functional.all_reduce``, so the raw functional op is used as is.
    """
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))


@communicates(Comm("all_gather", True, False, output_payload, "gather"))
def gather_from_tp(
    x: torch.Tensor,
    dim: int,
    group: str,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """Forward all-gather along ``dim`` (shards concatenated in rank order);
    backward this rank's slice of the gradient, no communication.

    Use where a sharded tensor becomes replicated (e.g. the hidden state before
    the final norm / LM head). Exact because the consumer is replicated: every
    rank holds the same full ``dL/dy`` and ``dL/dx_r`` is its block ``r``.
    (Funcol's own formula, a reduce-scatter, would scale by the world size.)

    ``rank`` / ``world_size`` are optional and only checked against the group:
    the sharding propagator writes them into the FX node so that the graph
    text, hence AOTAutograd's cache key, differs per rank.
    """
    rank, world = _rank_and_size(group, rank, world_size)
    return _GatherFromTP.apply(x, dim, group, rank, world)


@communicates(Comm("all_gather", False, True, _grad_payload, "scatter"))
def scatter_to_tp(
    x: torch.Tensor,
    dim: int,
    group: str,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """Forward this rank's slice along ``dim`` (no communication); backward
    all-gather of the gradient along ``dim``.

    Use where a replicated tensor is split into rank shards (the inverse of
    :func:`gather_from_tp`). Exact: ``x`` is replicated, its gradient is the
    concatenation of the shard gradients, which each rank holds one block of.
    ``rank`` / ``world_size``: as for :func:`gather_from_tp`.
    """
    rank, world = _rank_and_size(group, rank, world_size)
    return _ScatterToTP.apply(x, dim, group, rank, world)


# ----------------------------------------------------------------------------
# single-process fake group for graph-structure tests
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[str]:
    """Initialise torch's fake process group in this process; yields its name.

    Collectives on it do no communication and their values are not those of a
    real group (all-reduce leaves its input as is), but every primitive above
    runs eagerly and traces through dynamo, AOT and Inductor with the world size
    given, so graph-structure tests need no second process. The group is
    destroyed on exit. Fails if a default group already exists.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield group_name_of(None)
    finally:
        dist.destroy_process_group()
