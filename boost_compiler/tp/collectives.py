"""Tensor-parallel communication primitives the compiler inserts into dynamo graphs.

Each primitive takes a tensor and a process-group *name* (a plain ``str``, e.g.
``pg.group_name`` or :func:`group_name_of`). A string is a constant for every
tracer: dynamo, ``make_fx`` under AOTAutograd and Inductor keep it as a literal
argument of the ``_c10d_functional`` ops, so the same FX node runs eagerly and
under ``torch._inductor.compile_fx.compile_fx``.

The forward and backward communication are written with the raw functional
collectives (``torch.ops._c10d_functional.all_reduce`` / ``all_gather_into_tensor``
followed by ``wait_tensor``). When AOTAutograd traces a graph that calls one of
these primitives, the custom ``torch.autograd.Function`` is simply executed on
fake tensors, so the forward and backward graphs it produces contain the
collectives as ordinary ``_c10d_functional`` nodes (no opaque custom op, no
higher-order op). Inductor then lowers them like any other functional
collective (in-place ``all_reduce_`` on a buffer, bucketing, reordering).

Why ``autograd.Function`` (measured on torch 2.13, CPU, gloo and fake group):

* the detach trick for g (``ar(x.detach()) + (x - x.detach())``) also gives plain
  nodes, but leaves ``detach, sub, add`` in the forward graph, and turns an
  ``inf`` in ``x`` into ``nan``; f has no such trick without a forward collective.
* ``torch.library.custom_op`` + ``register_autograd`` shows a named, opaque
  node in the forward graph (the collective hidden inside it) and forces a
  copy for f, whose output may not alias its input.
* user code calling a primitive under ``torch.compile`` gets a
  ``higher_order.autograd_function_apply`` node in the *dynamo* graph (the
  collective inside ``fwd_body``/``bwd_body``); AOT inlines it, so the AOT and
  Inductor graphs again hold plain collectives, but AOTAutograd's cache is
  bypassed for such graphs. Nodes inserted by the compiler see none of this.

Gradient conventions (Megatron): a tensor is either *replicated* (every rank
holds the same value and computes the same thing from it) or *rank-varying*
(sharded or a partial sum). The loss is replicated, so the gradient of a
replicated tensor is the same on every rank and must not be summed again.

Pitfall recorded here: in torch 2.13 ``_c10d_functional.all_reduce`` carries an
autograd formula whose backward is another all-reduce, and
``all_gather_into_tensor``'s backward is a reduce-scatter. Those are right only
when the consumer is rank-varying; for Megatron's g (replicated consumer) they
multiply gradients by the world size. Hence the custom functions below.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_sum",
    "copy_to_tp",
    "fake_process_group",
    "gather_from_tp",
    "group_name_of",
    "mark_aot_cacheable",
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
# public primitives
# ----------------------------------------------------------------------------


def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's g: forward all-reduce SUM over ``group``, backward identity.

    Use where rank-varying partial sums (output of a row-parallel matmul) become
    a replicated tensor. Exact: ``y = sum_r x_r`` is consumed identically on every
    rank, so the replicated loss gives the same ``dL/dy`` everywhere and
    ``dL/dx_r = dL/dy``; summing it again would scale by the world size (which
    is what funcol's own autograd formula does).
    """
    return _ReduceFromTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's f: forward identity, backward all-reduce SUM of the gradient.

    Use where a replicated tensor enters rank-varying computation (input of a
    column-parallel matmul). Exact: every rank's shard of the computation
    contributes a partial ``dL/dx``; the true gradient of the replicated ``x`` is
    their sum, and it is again replicated after the all-reduce.
    """
    return _CopyToTP.apply(x, group)


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
    :func:`mark_aot_cacheable` writes them into the FX node so that the graph
    text, hence AOTAutograd's cache key, differs per rank.
    """
    rank, world = _rank_and_size(group, rank, world_size)
    return _GatherFromTP.apply(x, dim, group, rank, world)


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
# AOTAutograd cache
# ----------------------------------------------------------------------------

#: Hash of this module's source and the torch version: what an inserted node's
#: behaviour depends on beyond its graph arguments.
CACHE_HASH: str = hashlib.sha256(
    Path(__file__).read_bytes() + torch.__version__.encode()
).hexdigest()[:32]


def mark_aot_cacheable(node: torch.fx.Node) -> torch.fx.Node:
    """Let AOTAutograd's cache accept a call_function node that targets a primitive.

    AOTAutograd bypasses its cache for any call_function target that is not a
    torch op or public torch function (``Unsupported call_function target``).
    A node with ``meta["is_wrapped"]`` (what ``torch.fx.wrap`` sets) and a
    ``meta["user_cache_hash"]`` is accepted. In torch 2.13 that hash is only a
    permission: it does NOT enter the cache key (only saved-tensor-hook graphs
    fold it in). The key is the dynamo graph's code text plus configs, so:

    * rank-dependent tracing must show in the node's arguments. The dynamo graph
      is identical on all ranks while :func:`gather_from_tp` / :func:`scatter_to_tp`
      bake the rank (and world size) into the traced graph; without them in the
      text, a warm cache handed rank 0 the artifact rank 1 compiled (observed).
      This function writes ``rank=`` and ``world_size=`` kwargs into such nodes.
    * a change to this file does not invalidate AOT cache entries by itself:
      fold :data:`CACHE_HASH` into the ``uuid()`` of the compiler's
      ``CustomGraphPass`` (custom-pass uuids are part of the key).

    The inserted node also needs ``meta["example_value"]`` (a fake tensor) when
    a ``call_method`` node consumes it, else the cache is bypassed for that user.
    Side effect: the generated code calls ``torch.fx.wrap`` on the function name
    at import, which only matters to a later ``fx.symbolic_trace`` of that module.
    """
    if node.target in (gather_from_tp, scatter_to_tp):
        group = node.args[2] if len(node.args) > 2 else node.kwargs["group"]
        node.kwargs = {
            **node.kwargs,
            "rank": _group_rank(group),
            "world_size": _group_size(group),
        }
    node.meta["is_wrapped"] = True
    node.meta["user_cache_hash"] = CACHE_HASH
    return node


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
