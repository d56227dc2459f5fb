"""A fixed-support sparse matrix beside a bottleneck: SLTrain's ``W = B A + S``, held exactly.

SLTrain (andyjm3/SLTrain, ``splora/splora_linear.py``) re-parameterizes each projection as
a low-rank product plus a sparse ``S`` whose support (``sparse_index``, flat positions in
``[out, in]``) is drawn once and never moves; only its values (``sparse_value``) train.
:class:`SparsePart` holds ``S`` as a dense ``[out, in]`` weight and a boolean mask of the
support, and computes ``x @ (W * M)^T``:

* exact: off-support entries are zero in the forward, and their gradient is ``grad * 0``,
  so no optimizer step moves them (SGD, AdamW: a zero gradient and a zero weight stay
  zero), and the model can be written back as SLTrain's (index, value) pair;
* parallelizable as it is: an elementwise product and a dense linear, ops the TP planner
  places like any other (no sparse kernel it would have to gather around).

What it costs (why SLTrain's sparse part is the expensive half under tensor parallelism):
the dense ``S`` takes the memory of the dense projection it shares with the factors
(``out * in`` values and as many mask bytes; split over the ranks where the planner splits
it), a dense GEMM per token, and a collective as wide as the hidden per projection and
direction beside the bottleneck's ``[b, s, r]`` all-reduce (``d/r`` times its bytes): under
BTP the input is a hidden shard, so ``x @ S^T`` either reads it all-gathered (``S`` split
by output rows, or whole) or contracts the shard (``S`` split by input columns) into a
partial ``[b, s, out]`` that is reduce-scattered. ``ir/ops.py`` lets the planner see
``weight * mask`` as the weight (:func:`~boost_compiler.ir.ops.as_contraction`), so it
places ``S`` like any dense contraction, with no fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SparsePart", "from_entries", "to_entries"]


class SparsePart(nn.Module):
    """``x @ (weight * mask)^T``: a sparse matrix of fixed support, stored dense."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in, device=device, dtype=dtype))
        # Persistent: the support is part of the model (written with the weights).
        self.register_buffer("mask", torch.zeros(d_out, d_in, dtype=torch.bool, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask)


def from_entries(
    index: torch.Tensor, value: torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, mask)`` of :class:`SparsePart` from flat ``[out, in]`` positions and their
    values (SLTrain's ``sparse_index`` / ``sparse_value``); a position given twice adds
    up, as SLTrain's ``scatter_add_`` does."""
    flat_index = index.reshape(-1).to(torch.int64)
    weight = torch.zeros(shape[0] * shape[1], dtype=value.dtype)
    weight.scatter_add_(0, flat_index, value.reshape(-1))
    mask = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    mask[flat_index] = True
    return weight.view(shape), mask.view(shape)


def to_entries(weight: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The support (sorted flat positions, int64, as SLTrain sorts its draw) and its values."""
    index = mask.reshape(-1).nonzero().squeeze(1)
    return index, weight.detach().reshape(-1)[index]
