"""Graph boundaries that stay on the tensor-parallel shards: a pipeline stage's hidden state.

A parallelized graph reads its inputs whole and returns its outputs whole
(``tp/apply.py``), so a value that crosses from one parallelized graph to another, a
pipeline stage's hidden state, is all-gathered at the sender's output and sliced again
by the receiver's first shard-reading op. Two ops say, in the model's own code, that a
value crosses as shards instead:

* :func:`from_tp_shards` ``(x, dim, group)``: the global tensor whose blocks along ``dim``
  the ranks hold, ``x`` being this rank's block. Its meaning is an all-gather, and that
  is what it computes anywhere outside a parallelized graph; inside one the planner
  places its value ``S(dim)`` with ``x`` as the local block, so nothing is sent.
* :func:`to_tp_shard` ``(x, dim, group)``: this rank's block of ``x`` along ``dim``. Its
  meaning is a slice; inside a parallelized graph ``x`` is read as ``S(dim)`` (a shard
  costs nothing; a partial sum is reduce-scattered), and the block is returned as it is.

Invariant: both are ordinary exact ops with autograd (the gradient of the gathered
value is sliced, the gradient of the slice gathered), so a graph holding them computes
the same values and gradients whether or not the planner elides their communication.
They are ``torch.library`` custom ops so that dynamo records each as one named node
that the planner's rule (``rules/boundary.py``) recognises by its target, not by a name
or a convention. The rule accepts them only where the elision is exact: the input of
``from_tp_shards`` a graph input read by nothing else, the result of ``to_tp_shard``
read only by the graph's output.
"""

from __future__ import annotations

from typing import Any

import torch

from .collectives import _local_slice, _raw_all_gather
from .groups import rank_and_size

__all__ = ["from_tp_shards", "to_tp_shard", "BOUNDARY_OPS"]


def _global_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] *= world
    return shape


@torch.library.custom_op("boost::from_tp_shards", mutates_args=())
def _from_tp_shards(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    _, world = rank_and_size(group, None, None)
    return _raw_all_gather(x, dim, group, world)


@_from_tp_shards.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    _, world = rank_and_size(group, None, None)
    return x.new_empty(_global_shape(x, dim, world))


def _from_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.dim, ctx.group = inputs[1], inputs[2]


def _from_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    rank, world = rank_and_size(ctx.group, None, None)
    return _local_slice(grad, ctx.dim, rank, world).contiguous(), None, None


_from_tp_shards.register_autograd(_from_backward, setup_context=_from_setup)


@torch.library.custom_op("boost::to_tp_shard", mutates_args=())
def _to_tp_shard(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    rank, world = rank_and_size(group, None, None)
    return _local_slice(x, dim, rank, world).clone()


@_to_tp_shard.register_fake
def _(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    _, world = rank_and_size(group, None, None)
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


def _to_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.dim, ctx.group = inputs[1], inputs[2]


def _to_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    _, world = rank_and_size(ctx.group, None, None)
    return _raw_all_gather(grad, ctx.dim, ctx.group, world), None, None


_to_tp_shard.register_autograd(_to_backward, setup_context=_to_setup)

# How dynamo records each op (the op table's spellings): the packet a call through
# ``torch.ops.boost.<name>`` gives, and the overload that ``make_fx`` and AOT give.
BOUNDARY_OPS = {
    "from_tp_shards": (torch.ops.boost.from_tp_shards, torch.ops.boost.from_tp_shards.default),
    "to_tp_shard": (torch.ops.boost.to_tp_shard, torch.ops.boost.to_tp_shard.default),
}


def from_tp_shards(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The global tensor whose blocks along ``dim`` the ranks of ``group`` hold, ``x``
    being this rank's (an all-gather; no communication inside a parallelized graph).

    ``dim`` is counted from the front (non-negative), as the placements are."""
    return torch.ops.boost.from_tp_shards(x, dim, group)


def to_tp_shard(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication inside a parallelized
    graph where ``x`` is already sharded along ``dim``)."""
    return torch.ops.boost.to_tp_shard(x, dim, group)
