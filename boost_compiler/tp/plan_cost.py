"""What a strategy costs one rank: the planner's cost model, read off the strategy's data.

Invariant: a cost is computed from a strategy and the placements around it, never from
a rewritten graph, and counts exactly the collectives the applier will insert for it:
each conversion of an input (once per value and placement: a conversion another node
already planned is free), the conversion after a partial result, ``f`` on replicated
inputs of a rank-varying node (an all-reduce in the backward), and what the rule said
its own call communicates (a sharded norm's statistics). Bytes are what a rank sends
with ring algorithms (all-reduce ``2(p-1)/p N``, all-gather and reduce-scatter
``(p-1)/p N``), forward plus backward; a gradient is only sent for a value that
requires one. Work every rank repeats on a whole value is counted too, as the FLOPs a
sharded evaluation would have saved, and so is memory: a parameter the strategy fixes
replicated is held whole on every rank (``held``, priced in ``Cost.seconds``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from ..ir.ops import value_of
from .placement import P, Placement, R
from .strategy import Cost

# FLOPs per output element of an op computed whole (a rough count; contractions apart).
_FLOPS_PER_ELEMENT = 4.0


def nbytes(v: Any) -> float:
    if not isinstance(v, torch.Tensor):
        return 0.0
    return float(v.numel() * v.element_size())


def all_reduce(n: float, p: int) -> float:
    return 2 * (p - 1) / p * n


def gather(n: float, p: int) -> float:
    return (p - 1) / p * n


def conversion(v: Any, src: Placement, dst: Placement, p: int) -> Cost:
    """``v`` (its global value) converted from ``src`` to ``dst``, forward and backward."""
    if src == dst or not isinstance(v, torch.Tensor):
        return Cost()
    n, grad = nbytes(v), bool(v.requires_grad)
    if src == P and dst == R:  # all-reduce; its backward passes the gradient through
        return Cost(all_reduce(n, p), 1, logical=n)
    if src == P:  # reduce-scatter; backward all-gathers the gradient
        return Cost(gather(n, p) * (1 + grad), 1 + grad, logical=n * (1 + grad))
    if dst == R:  # all-gather; backward takes this rank's slice of the gradient
        return Cost(gather(n, p), 1, logical=n)
    if src == R:  # a slice; backward all-gathers the gradient
        return Cost(gather(n, p) * grad, int(grad), logical=n * grad)
    return conversion(v, src, R, p) + conversion(v, R, dst, p)  # another split: via whole


def copy_in(v: Any, p: int, gathered: bool = False) -> Cost:
    """``f`` on a replicated value read by a rank-varying op: its gradient all-reduced, or,
    on a value just gathered, reduce-scattered (``gather_sum_grad``)."""
    if not isinstance(v, torch.Tensor) or not v.requires_grad:
        return Cost()
    n = nbytes(v)
    return Cost(gather(n, p) if gathered else all_reduce(n, p), 1, logical=n)


def all_reduces(sizes: Iterable[float], p: int) -> Cost:
    """A call's own all-reduces of these byte sizes (statistics, a reduction's result)."""
    return total(Cost(all_reduce(n, p), 1, logical=n) for n in sizes)


def gathers(sizes: Iterable[float], p: int) -> Cost:
    """A call's own all-gathers of these byte sizes (their gathered results)."""
    return total(Cost(gather(n, p), 1, logical=n) for n in sizes)


def per_token(v: Any, width: int) -> float:
    """Bytes of fp32 ``[..., width]`` per token of ``v`` (a norm's or a loss's statistics)."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return 0.0
    return float(v.numel() // v.shape[-1] * width * 4)


def held(v: Any, p: int) -> Cost:
    """A parameter ``v`` kept whole on every rank: the ``(p-1)/p`` of it (and of its gradient,
    when it has one) that a split would leave on the other ranks."""
    if not isinstance(v, torch.Tensor):
        return Cost()
    return Cost(held=gather(nbytes(v), p) * (1 + bool(v.requires_grad)))


def replicated_work(node: fx.Node, p: int) -> Cost:
    """The FLOPs every rank repeats computing ``node`` whole that a shard would not."""
    v = value_of(node)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return Cost()
    return Cost(replicated_flops=_FLOPS_PER_ELEMENT * v.numel() * (p - 1) / p)


def total(costs: Iterable[Cost]) -> Cost:
    out = Cost()
    for c in costs:
        out = out + c
    return out
