"""Placements of a tensor over the tensor-parallel group, and how views move them.

``R`` replicated (every rank holds the full, identical value), ``S(d)`` sharded
in contiguous blocks along dim ``d`` (rank i holds block i), ``P`` partial (the
value is the sum of the ranks' tensors). A shard may be *blocked*: dim ``d``
is a concatenation of logical blocks (a fused q/k/v projection's three outputs, or
the heads of each sequence once batch and heads are merged) and rank i holds the i-th
slice of every block, so a ``split`` into the blocks, or a view back to ``[b, H, ..]``,
works on the local tensor and yields plain shards. The same vocabulary as DTensor's
Replicate/Shard/Partial; DTensor itself is not used because the placements here
are decided per FX node by the compiler, and the graph stays plain tensors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PlanFileError

_SHARD = re.compile(r"S\((\d+)(?:, blocks=\[([\d, ]*)\])?\)")


@dataclass(frozen=True)
class Placement:
    kind: str  # "R", "S" or "P"
    dim: int = -1  # for "S": a non-negative dim
    blocks: tuple[int, ...] = ()  # for a blocked "S": global block sizes along dim

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        return f"S({self.dim}, blocks={list(self.blocks)})" if self.blocks else f"S({self.dim})"

    @staticmethod
    def parse(text: str, where: str = "") -> Placement:
        """``"R"``, ``"P"``, ``"S(1)"`` or ``"S(1, blocks=[64, 32, 32])"``, as ``str()`` writes."""
        text = text.strip()
        if text in ("R", "P"):
            return Placement(text)
        m = _SHARD.fullmatch(text)
        if m is None:
            raise PlanFileError(f"{where or 'placement'}: {text!r} is not a placement; write "
                                "R, S(dim) or S(dim, blocks=[sizes])")  # fmt: skip
        blocks = tuple(int(b) for b in (m.group(2) or "").split(",") if b.strip())
        return Placement("S", int(m.group(1)), blocks)

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    def shard(self, full: torch.Tensor, rank: int, p: int) -> torch.Tensor:
        """This rank's piece of a full (global) tensor: what a parameter becomes."""
        if not self.is_shard:
            return full
        if not self.blocks:
            return full.chunk(p, dim=self.dim)[rank]
        return torch.cat([b.chunk(p, self.dim)[rank] for b in self._split(full)], self.dim)

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece (in rank order)."""
        if not self.is_shard:
            return parts[0]
        if not self.blocks:
            return torch.cat(list(parts), self.dim)
        p = len(parts)
        local = [size // p for size in self.blocks]
        per_rank = [part.split(local, self.dim) for part in parts]
        return torch.cat(
            [torch.cat([pieces[i] for pieces in per_rank], self.dim) for i in range(len(local))],
            self.dim,
        )

    def _split(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return full.split(list(self.blocks), self.dim)


R = Placement("R")
P = Placement("P")


def S(dim: int, blocks: Sequence[int] = ()) -> Placement:
    return Placement("S", dim, tuple(blocks))


def unblock(gathered: torch.Tensor, dim: int, blocks: Sequence[int], p: int) -> torch.Tensor:
    """Reorder an all-gathered blocked shard ``[r0: b0/p b1/p .., r1: ..]`` to global order.

    Plain differentiable tensor ops, so the gather's backward composes with it.
    """
    return S(dim, blocks).unshard(gathered.chunk(p, dim))


def rank_major(full: torch.Tensor, dim: int, blocks: Sequence[int], p: int) -> torch.Tensor:
    """A replicated value reordered so that a plain scatter hands each rank its blocked shard.

    The inverse of :func:`unblock`; plain differentiable tensor ops, so the scatter's
    backward (an all-gather of the gradient) composes with it.
    """
    pl = S(dim, blocks)
    return torch.cat([pl.shard(full, r, p) for r in range(p)], dim)


def view_groups(src: Sequence[Any], dst: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source dims with runs of destination dims of equal numel.

    ``[2, 8, 64] -> [2, 8, 4, 16]`` gives ``[([0],[0]), ([1],[1]), ([2],[2,3])]``.
    Size-1 dims attach to the neighbouring group. Symbolic sizes compare by
    identity of their product, which is all a view can rely on either.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if pi == pj and gi and gj:
                # absorb trailing size-1 dims into this group
                while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
                    gi.append(i)
                    i += 1
                while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
                    gj.append(j)
                    j += 1
                break
            if (pi <= pj or j >= len(dst)) and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        if not gi and not gj:
            break
        groups.append((gi, gj))
    return groups


def shard_through_view(
    src: Sequence[Any], dst: Sequence[Any], dim: int, p: int
) -> tuple[int, int] | None:
    """Where a shard on ``src[dim]`` lands after viewing ``src`` as ``dst``.

    Returns ``(dst_dim, divisor)``: the destination dim that is sharded and
    the size that must divide by ``p`` (the caller checks it), or None when the view mixes the
    sharded dim with others in a way contiguous blocks cannot follow (then the
    caller gathers). A block shard survives a view when the sharded dim is
    the leading dim of its group (its blocks stay contiguous).
    """
    for gi, gj in view_groups(src, dst):
        if dim not in gi:
            continue
        core_i = [d for d in gi if src[d] != 1]
        core_j = [d for d in gj if dst[d] != 1]
        if not core_i or core_i[0] != dim or not core_j:
            return None
        lead = core_j[0]
        if len(core_i) == 1:
            # split (or identity): [64] -> [4, 16]; shard follows the leading dim
            return (lead, dst[lead]) if _static(dst[lead]) else None
        # merge: [4, 16] -> [64]; the leading src dim is sharded, so blocks stay whole
        if len(core_j) == 1 and _static(src[dim]):
            return lead, src[dim]
        return None
    return None


def _static(x: Any) -> bool:
    return isinstance(x, int)


# More blocks than this and a merged shard is gathered instead: its placement is written
# out block by block (plans, explain), and a merge of tokens is no head layout anyway.
MAX_BLOCKS = 1024


def blocks_through_view(
    src: Sequence[Any], dst: Sequence[Any], pl: Placement, p: int
) -> Placement | None:
    """Where a shard that a plain view cannot keep contiguous lands: as equal blocks.

    Two cases, each the same local tensor on every rank, so the view stays local:

    * a merge whose sharded dim is not the leading one, ``[b, H, s] -> [b*H, s]`` with
      ``H`` split (Bloom's ``reshape(batch * heads, ...)``): the merged dim is ``b``
      blocks, each ``H`` times the merged dims after it long, and each rank holds its
      contiguous slice of every block, ``S(0, blocks=[H]*b)``;
    * the inverse split of such equal blocks, ``[b*H, s] -> [b, H, s]``: the plain shard
      of the first dim after the ``b`` prefix.

    A blocked shard whose dim the view leaves alone keeps its blocks. None for anything
    else (a view that moves values across ranks: the caller gathers). Static sizes only.
    """
    if not pl.is_shard or not all(_static(x) for x in (*src, *dst)):
        return None
    for gi, gj in view_groups(src, dst):
        if pl.dim not in gi:
            continue
        core_i = [d for d in gi if src[d] != 1] or [pl.dim]
        core_j = [d for d in gj if dst[d] != 1]
        if not core_j:
            return None
        if pl.blocks:
            if core_i != [pl.dim]:
                return None
            if len(core_j) == 1:  # the blocked dim itself, under a new index
                return S(core_j[0], pl.blocks)
            return _split_blocks(pl.blocks, [dst[d] for d in core_j], core_j, p)
        if len(core_j) != 1 or pl.dim not in core_i or core_i[0] == pl.dim:
            return None
        at = core_i.index(pl.dim)
        count = math.prod(src[d] for d in core_i[:at])
        block = math.prod(src[d] for d in core_i[at:])
        if src[pl.dim] % p or count > MAX_BLOCKS:
            return None
        return S(core_j[0], (block,) * count)
    return None


def _split_blocks(
    blocks: tuple[int, ...], sizes: list[int], dims: list[int], p: int
) -> Placement | None:
    """Equal blocks split into ``[count, ...]``: the first dim after the count is sharded."""
    if len(set(blocks)) != 1:
        return None
    prefix = 1
    for m, size in enumerate(sizes):
        if prefix == len(blocks):
            return S(dims[m]) if size % p == 0 else None
        prefix *= size
    return None
