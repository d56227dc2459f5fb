"""Training data: the embedded corpus (byte windows drawn per step) or files (:mod:`.stream`).

:func:`open_data` returns the run's :class:`DataSource`, :func:`open_eval` its held-out
sequences. Without ``--data``, the embedded corpus below.

Why the embedded corpus' batch is a pure function of ``(seed, step)`` instead of an
iterator: the data position then *is* the step count. A run resumed from step N, at any (dp, tp)
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
from typing import Any, Protocol

import torch

from .._logging import get_logger
from ..errors import DataError
from ..models.corpus import stdlib_corpus_bytes
from .config import TrainConfig, TrainConfigError

log = get_logger(__name__)


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


class DataSource(Protocol):
    """What the training loop reads its batches from, and saves the position of."""

    @property
    def source(self) -> str:
        """What the data is, for messages and the metrics."""
        ...

    @property
    def digest(self) -> str:
        """Recognises the same data on resume."""
        ...

    def rows(self, step: int) -> torch.Tensor:
        """This dp rank's ``[batch / dp, seq]`` rows of step ``step``'s global batch."""
        ...

    def example(self) -> torch.Tensor:
        """Rows like the next :meth:`rows` (to capture the model), without consuming any."""
        ...

    def describe(self) -> dict[str, Any]:
        """The tokenizer and its EOS, for the metrics' start record (no collective)."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON saved in the checkpoint's ``train_state.json`` (a collective)."""
        ...

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue where the run that saved ``state()`` left off."""
        ...


@dataclass
class RandomWindows:
    """The embedded corpus as a :class:`DataSource`: nothing to restore, the step decides."""

    corpus: Corpus
    batch: int
    seq: int
    seed: int
    dp_rank: int
    dp: int

    @property
    def source(self) -> str:
        return self.corpus.source

    @property
    def digest(self) -> str:
        return self.corpus.digest

    def rows(self, step: int) -> torch.Tensor:
        full = self.corpus.global_batch(step, self.batch, self.seq, self.seed)
        return dp_slice(full, self.dp_rank, self.dp)

    def example(self) -> torch.Tensor:
        return self.rows(0)

    def describe(self) -> dict[str, Any]:
        return {"tokenizer": "UTF-8 bytes"}

    def state(self) -> dict[str, Any]:
        return self.describe()

    def restore(self, saved: dict[str, Any]) -> None:
        return None


def _paths(value: str | list[str] | None) -> list[str]:
    """A TOML file may give one path as a string; the flags give a list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _options(cfg: TrainConfig) -> Any:
    from .stream import ReadOptions

    return ReadOptions(cfg.text_field, cfg.txt_unit, cfg.eval_fraction)


def check_paths(cfg: TrainConfig) -> None:
    """``--data`` / ``--eval-data`` name readable data files (:class:`DataError` naming the
    path and what it is): checked with the flags, before the run folder is claimed (which
    ``--overwrite`` clears) or a model is built."""
    from .stream import resolve_files

    for flag, value in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if _paths(value):
            resolve_files(_paths(value), flag)


def open_data(cfg: TrainConfig, dp_rank: int, dp: int) -> DataSource:
    """``--data`` through the tokenizer (:mod:`.stream`), or the embedded corpus."""
    if not _paths(cfg.data):
        return RandomWindows(load_corpus(None), cfg.batch, cfg.seq, cfg.seed, dp_rank, dp)
    from .stream import TokenStream, resolve_files
    from .tokenizer import load_tokenizer

    files = resolve_files(_paths(cfg.data), "--data")
    tok = load_tokenizer(cfg.tokenizer, cfg.eos_token)
    stream = TokenStream(files, tok, _options(cfg), cfg.batch, cfg.seq, dp_rank, dp)
    log.info("data: %s, %s (vocab %d), documents end with EOS %s (id %d)", stream.source,
             tok.name, tok.vocab_size, tok.eos_token, tok.eos_id)  # fmt: skip
    return stream


def open_eval(cfg: TrainConfig) -> torch.Tensor | None:
    """The held-out sequences, ``[batches, batch, seq]`` (None without a held-out split).

    The first ``eval_batches`` global batches of the split, the same at every evaluation
    and every (dp, tp): so successive validation losses compare, and resumed runs match.
    """
    if not (cfg.eval_fraction or _paths(cfg.eval_data)):
        return None
    from .stream import eval_sequences, resolve_files
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer, cfg.eos_token)
    want = cfg.eval_batches * cfg.batch
    if _paths(cfg.eval_data):
        files = resolve_files(_paths(cfg.eval_data), "--eval-data")
        seqs = eval_sequences(files, tok, _options(cfg), "all", want, cfg.seq)
    else:
        files = resolve_files(_paths(cfg.data), "--data")
        seqs = eval_sequences(files, tok, _options(cfg), "eval", want, cfg.seq)
    n = seqs.shape[0] // cfg.batch
    if n == 0:
        what = "--eval-data" if cfg.eval_data else f"--eval-fraction {cfg.eval_fraction}"
        raise DataError(
            f"the held-out split ({what}) packs into {seqs.shape[0]} sequence(s) of {cfg.seq} "
            f"tokens, fewer than one batch ({cfg.batch}): give more held-out text"
        )
    if n < cfg.eval_batches:
        log.warning("held-out split: %d batch(es) of %d sequences, not --eval-batches %d",
                    n, cfg.batch, cfg.eval_batches)  # fmt: skip
    return seqs[: n * cfg.batch].reshape(n, cfg.batch, cfg.seq)


def model_vocab(cfg: TrainConfig) -> int | None:
    """The tokenizer's vocabulary size when ``--tokenizer`` is given (None: byte tokens)."""
    if cfg.tokenizer is None:
        return None
    from .tokenizer import load_tokenizer

    return load_tokenizer(cfg.tokenizer, cfg.eos_token).vocab_size
