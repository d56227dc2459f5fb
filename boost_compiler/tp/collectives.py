"""Tensor-parallel communication primitives: Megatron's f and g, gathers, scatters.

Each primitive takes a tensor and a process-group *name* (a ``str``: a literal
for dynamo, ``make_fx`` and Inductor alike, so one FX node runs eagerly and
compiled), gives exact values and gradients under Megatron's conventions (see
"autograd functions"), and registers what it communicates in the table of
:mod:`.comm_table`, through which :func:`graph_collectives` reads any graph's
collectives off its nodes (the names of that module and of :mod:`.groups` are
re-exported here, where the passes and tests look for them).
"""

from __future__ import annotations

import torch

from .comm_table import (
    COMMUNICATION,
    WHY_META,
    Collective,
    Comm,
    Payload,
    communicates,
    forward_communicating,
    grad_payload,
    graph_collectives,
    input_payload,
    output_payload,
    statistics_payload,
)
from .groups import fake_process_group, group_name_of, rank_and_size

__all__ = [
    "COMMUNICATION",
    "WHY_META",
    "Collective",
    "Comm",
    "Payload",
    "all_reduce_sum",
    "communicates",
    "copy_to_tp",
    "fake_process_group",
    "forward_communicating",
    "gather_from_tp",
    "gather_sum_grad",
    "graph_collectives",
    "group_name_of",
    "input_payload",
    "output_payload",
    "reduce_from_tp",
    "reduce_scatter_to_tp",
    "scatter_to_tp",
    "statistics_payload",
]

_c10d = torch.ops._c10d_functional


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


def _raw_reduce_scatter(x: torch.Tensor, dim: int, group: str, world: int) -> torch.Tensor:
    """Reduce-scatter (sum) along ``dim``: rank ``r`` gets block ``r`` of the sum.

    ``reduce_scatter_tensor`` splits dim 0; another dim is moved to the front
    (and back), which costs a copy on each side but keeps the blocks in rank order.
    """
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(front, "sum", world, group))
    return out.movedim(0, dim)


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


class _ReduceScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str, world: int):
        ctx.dim, ctx.group, ctx.world = dim, group, world
        return _raw_reduce_scatter(x, dim, group, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _raw_all_gather(grad, ctx.dim, ctx.group, ctx.world), None, None, None


class _GatherSumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str, world: int):
        ctx.dim, ctx.group, ctx.world = dim, group, world
        return _raw_all_gather(x, dim, group, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _raw_reduce_scatter(grad, ctx.dim, ctx.group, ctx.world), None, None, None


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
    the applier writes them into the FX node so that the graph
    text, hence AOTAutograd's cache key, differs per rank.
    """
    rank, world = rank_and_size(group, rank, world_size)
    return _GatherFromTP.apply(x, dim, group, rank, world)


@communicates(Comm("all_gather", False, True, grad_payload, "scatter"))
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
    rank, world = rank_and_size(group, rank, world_size)
    return _ScatterToTP.apply(x, dim, group, rank, world)


@communicates(
    Comm("reduce_scatter", True, False, input_payload, "partial to shard"),
    Comm("all_gather", False, True, input_payload, "partial to shard"),
)
def reduce_scatter_to_tp(
    x: torch.Tensor,
    dim: int,
    group: str,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """Forward reduce-scatter (sum) along ``dim``; backward all-gather of the gradient.

    Use where rank-varying partial sums become a shard (a vocabulary-parallel
    embedding's lookup onto the hidden shards): the all-reduce then slice of
    ``reduce_from_tp`` + ``scatter_to_tp`` in one collective of half the bytes.
    Exact: every rank's partial ``x_r`` reaches every block of the sum, so
    ``dL/dx_r`` is the concatenation of all shards' gradients. ``rank`` /
    ``world_size``: as for :func:`gather_from_tp`.
    """
    _, world = rank_and_size(group, rank, world_size)
    return _ReduceScatterToTP.apply(x, dim, group, world)


@communicates(
    Comm("all_gather", True, False, output_payload, "gather"),
    Comm("reduce_scatter", False, True, output_payload, "gather"),
)
def gather_sum_grad(
    x: torch.Tensor,
    dim: int,
    group: str,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """Forward all-gather along ``dim``; backward reduce-scatter (sum) of the gradient.

    ``copy_to_tp(gather_from_tp(x))`` in one primitive, for a gathered value whose
    every consumer is rank-varying (the input of a vocabulary-parallel head): its
    gradient is a partial sum on each rank, and this rank's block of the sum is
    all ``x`` needs, so the backward all-reduce + slice becomes a reduce-scatter
    of half the bytes. (This is funcol's own all-gather formula; it is exact only
    for such consumers, which is why the passes, not users, insert it.)
    """
    _, world = rank_and_size(group, rank, world_size)
    return _GatherSumGrad.apply(x, dim, group, world)
