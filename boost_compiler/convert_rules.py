"""What every converter of ``to_low_rank`` shares: the report row, pattern matching, the
rank rule, the weights an SVD can take (:mod:`.convert` for linear layers,
:mod:`.convert_experts` for routed experts)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import ConversionError, RankError


@dataclass(frozen=True)
class LayerConversion:
    """One converted projection. FLOPs are per token, ``2 x`` multiply-adds, bias excluded."""

    name: str
    kind: str
    d_in: int
    rank: int
    d_out: int
    params_before: int
    params_after: int
    flops_before: int
    flops_after: int
    rel_error: float | None = None  # ||W - up @ down||_F / ||W||_F (svd only)


def covered(name: str, patterns: Sequence[str]) -> str | None:
    """The first pattern matching ``name`` or one of its ancestors."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    for pat in patterns:
        if any(fnmatch.fnmatchcase(pre, pat) for pre in prefixes):
            return pat
    return None


def choose_rank(
    name: str, d_in: int, d_out: int, rank: int | None, ratio: float, multiple_of: int
) -> tuple[int | None, str]:
    """The rank for one layer, or ``(None, why)`` when a ratio-derived rank is unusable."""
    m = min(d_in, d_out)
    if rank is not None:
        if rank >= m:
            raise RankError(
                f"rank {rank} is not below min(d_in, d_out) = {m} of '{name}' "
                f"({d_in} -> {d_out}): no bottleneck; exclude it or use a smaller rank"
            )
        return rank, ""
    r = int(ratio * m) // multiple_of * multiple_of
    if r <= 0:
        return None, f"rank_ratio {ratio} x {m} rounds to 0 (multiple_of={multiple_of})"
    return r, ""


def refuse_non_finite(name: str, w: torch.Tensor) -> None:
    """A weight with NaN or infinite values has no SVD (LAPACK fails to converge, raising
    ``torch.linalg.LinAlgError`` mid-conversion): named here, before any module changes."""
    bad = ~torch.isfinite(w.detach())
    if bool(bad.any()):
        nan = int(torch.isnan(w.detach()).sum())
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ConversionError(
            f"'{name}' {tuple(w.shape)} holds {nan} NaN and {int(bad.sum()) - nan} infinite "
            f"value(s) (the first at {where}): its SVD is undefined. The weights come from a "
            "diverged or damaged checkpoint: load an earlier one, or repair the tensor"
        )
