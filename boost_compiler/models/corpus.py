"""The default training corpus: the Python standard library's own sources.

Real text that ships with every Python install, so the demo and the training
job need no download. Tokens are bytes (vocabulary 256).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB_SIZE = 256


def stdlib_corpus_bytes(max_bytes: int = 4 << 20) -> bytes:
    """Up to ``max_bytes`` of ``.py`` sources from the stdlib, as bytes.

    Files are read in sorted order, so the corpus is the same on every run
    and every rank of the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    return b"".join(chunks)[:max_bytes]


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """:func:`stdlib_corpus_bytes` as a uint8 tensor."""
    return torch.frombuffer(bytearray(stdlib_corpus_bytes(max_bytes)), dtype=torch.uint8)


def random_batches(
    tokens: torch.Tensor, batch: int, seq: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """Endless ``[batch, seq]`` int64 windows at seeded random offsets."""
    if tokens.numel() <= seq:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too short for seq={seq}")
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=gen)
        yield torch.stack([tokens[s : s + seq] for s in starts.tolist()]).long()
