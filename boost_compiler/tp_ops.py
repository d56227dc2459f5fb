"""Shard-aware replacements the sharding pass puts into graphs.

Each takes the local shard of the last dimension and returns exactly what the
single-device op returns for that shard, using a small all-reduce of per-token
statistics. They are plain Python functions called from FX nodes: AOTAutograd
traces through them, so their collectives appear in the forward and backward
graphs like any other functional collective.
"""

from __future__ import annotations

import torch

from .collectives import copy_to_tp, reduce_from_tp


def sharded_sum(x: torch.Tensor, dim: int, keepdim: bool, full: int, group: str) -> torch.Tensor:
    """``x.sum(dim)`` over a dim split across the group (``full`` is its global size)."""
    return reduce_from_tp(x.sum(dim, keepdim=keepdim), group)


def sharded_mean(x: torch.Tensor, dim: int, keepdim: bool, full: int, group: str) -> torch.Tensor:
    """``x.mean(dim)`` over a dim split across the group."""
    return reduce_from_tp(x.sum(dim, keepdim=keepdim), group) / full


def sharded_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, d: int, group: str
) -> torch.Tensor:
    """``torch.rms_norm(x_full, (d,), weight_full, eps)`` restricted to this shard.

    Statistics in fp32 (as torch computes them for low-precision inputs); the
    global sum of squares is one all-reduce of ``[..., 1]``. ``copy_to_tp``
    sums the partial gradients of the scale in the backward.
    """
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    xf = x.float()
    ss = reduce_from_tp(xf.pow(2).sum(-1, keepdim=True), group)
    inv = copy_to_tp(torch.rsqrt(ss / d + eps), group)
    y = (xf * inv).to(x.dtype)
    return y * weight if weight is not None else y


def sharded_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float | None,
    d: int,
    group: str,
) -> torch.Tensor:
    """``F.layer_norm(x_full, (d,), weight_full, bias_full, eps)`` on this shard.

    Two-pass statistics (mean, then centred sum of squares), as torch does,
    so the fp32 result does not suffer the cancellation of E[x^2] - E[x]^2.
    """
    eps = 1e-5 if eps is None else eps
    xf = x.float()
    mean = copy_to_tp(reduce_from_tp(xf.sum(-1, keepdim=True), group) / d, group)
    centred = xf - mean
    var = reduce_from_tp(centred.pow(2).sum(-1, keepdim=True), group) / d
    y = (centred * copy_to_tp(torch.rsqrt(var + eps), group)).to(x.dtype)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def sharded_dropout(
    x: torch.Tensor, p: float, training: bool, dim: int, rank: int, world: int
) -> torch.Tensor:
    """``F.dropout`` of a shard: this rank's slice of one mask drawn for the global shape.

    Every rank of a tensor-parallel group draws from the same random stream
    (``parallelize`` synchronises it), so dropping the local shard directly
    would give each rank the *same* mask pattern: correlated across shards.
    Drawing the global mask and keeping this rank's slice gives independent,
    correctly distributed masks per shard and keeps the streams in lockstep
    (every rank consumes the same numbers), which is what keeps dropout on
    replicated tensors bit-identical across ranks. The cost is p times the
    random numbers of the shard, only where dropout is on.
    """
    if not training or p == 0.0:
        return x
    shape = list(x.shape)
    shape[dim] *= world
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    return x * keep.narrow(dim, rank * x.shape[dim], x.shape[dim]) / (1.0 - p)
