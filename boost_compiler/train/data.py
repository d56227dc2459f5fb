"""Training data: byte tokens, and the global batch of a step as a pure function of the step.

Why a pure function of ``(seed, step)`` instead of an iterator: the data
position then *is* the step count. A run resumed from step N, at any (dp, tp)
layout, draws exactly the batches N, N+1, ... the uninterrupted run drew, with
no reader state to checkpoint or replay. Every rank computes the same global
batch; a dp rank keeps its contiguous slice of rows (disjoint across dp ranks),
the tp ranks of one dp group keep the same slice. Since every row has ``seq``
tokens, the mean of the dp ranks' mean losses is the global batch's mean loss,
whatever the layout.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.corpus import stdlib_corpus_bytes
from .config import TrainConfigError


@dataclass(frozen=True)
class Corpus:
    """The token stream (uint8 bytes) and a fingerprint to recognise it on resume."""

    tokens: torch.Tensor
    source: str
    digest: str

    def global_batch(self, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
        """``[batch, seq]`` int64 windows at offsets drawn from a generator seeded by (seed, step)."""
        n = self.tokens.numel()
        if n <= seq:
            raise TrainConfigError(f"corpus {self.source} has {n} tokens, too few for seq={seq}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, n - seq, (batch,), generator=gen)
        return torch.stack([self.tokens[s : s + seq] for s in starts.tolist()]).long()


def dp_slice(global_batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Rows ``[dp_rank * b/dp, (dp_rank + 1) * b/dp)`` of the global batch."""
    return global_batch.chunk(dp, dim=0)[dp_rank]


def load_corpus(path: str | None, max_bytes: int = 64 << 20) -> Corpus:
    """Every file under ``path`` (sorted, recursive, joined by newlines) or the stdlib corpus."""
    if path is None:
        blob = stdlib_corpus_bytes()
        source = "embedded stdlib corpus"
    else:
        root = Path(path)
        if not root.is_dir():
            raise TrainConfigError(f"--data {path}: not a folder of text files")
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise TrainConfigError(f"--data {path}: no files")
        blob = b"\n".join(f.read_bytes() for f in files)[:max_bytes]
        source = f"{len(files)} file(s) under {root}"
    # The digest from the bytes themselves (no numpy at run time: not a dependency).
    digest = hashlib.sha256(blob).hexdigest()[:16]
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return Corpus(tokens, source, digest)
