"""Tokenizers for ``boost train --data``: a ``tokenizer.json``, a ``transformers`` folder, or bytes.

Every tokenizer is reduced to the same small surface (:class:`TextTokenizer`): a batch
encoder without special tokens, the vocabulary size the model must hold, and the one
end-of-sequence id the packer puts after every document. Special tokens are left out of
the encoding on purpose: a tokenizer whose post-processor adds BOS/EOS per call would
otherwise mark the boundaries twice, and differently for each kind of tokenizer.

Which EOS: ``--eos-token`` if given; otherwise a ``transformers`` tokenizer's own
``eos_token``; otherwise the first of :data:`EOS_CANDIDATES` in the vocabulary. Without
``--tokenizer`` the tokens are the UTF-8 bytes of the text (ids 0-255, as the embedded
corpus) and the separator is the NUL byte (id 0), which text files do not contain.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError

# Conventional end-of-text spellings, most common first (GPT-2, LLaMA/T5, Gemma, LLaMA-3, BERT).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "[EOS]")
BYTE_EOS = 0


@dataclass(frozen=True)
class TextTokenizer:
    """What training needs from a tokenizer."""

    name: str  # where it came from, for messages and the metrics
    vocab_size: int  # every id is below this
    eos_id: int
    eos_token: str
    encode: Callable[[list[str]], list[list[int]]]  # texts -> ids, no special tokens
    digest: str  # recognises the same tokenizer on resume

    def describe(self) -> dict[str, object]:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size,
                "eos_token": self.eos_token, "eos_id": self.eos_id}  # fmt: skip


def _bytes_tokenizer() -> TextTokenizer:
    def encode(texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    return TextTokenizer("UTF-8 bytes", 256, BYTE_EOS, "\\x00 (NUL byte)", encode, "bytes")


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _eos(path: Path, eos_token: str | None, own: str | None, lookup: Callable[[str], int | None]
         ) -> tuple[str, int]:  # fmt: skip
    """The separator's (token, id): --eos-token, the tokenizer's own, or a known spelling."""
    names = [eos_token] if eos_token is not None else [t for t in (own, *EOS_CANDIDATES) if t]
    for name in names:
        tid = lookup(name)
        if tid is not None:
            return name, tid
    if eos_token is not None:
        raise DataError(f"--eos-token {eos_token!r} is not in the vocabulary of {path}")
    raise DataError(
        f"{path} has no end-of-sequence token (tried {', '.join(EOS_CANDIDATES)}): name the "
        "token that separates documents with --eos-token"
    )


def _from_json(path: Path, eos_token: str | None) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise DataError(f"--tokenizer {path}: not a tokenizers tokenizer.json ({err})") from err
    name, eos_id = _eos(path, eos_token, None, tok.token_to_id)

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    vocab = tok.get_vocab_size(with_added_tokens=True)
    return TextTokenizer(str(path), vocab, eos_id, name, encode, _file_digest([path]))


def _from_folder(path: Path, eos_token: str | None) -> TextTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if (path / "tokenizer.json").is_file():  # the fast tokenizer alone needs no transformers
            return _from_json(path / "tokenizer.json", eos_token)
        raise DataError(
            f"--tokenizer {path}: a tokenizer folder needs transformers (pip install "
            "'boost-compiler[hf]'), or pass its tokenizer.json"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise DataError(f"--tokenizer {path}: no tokenizer in this folder ({err})") from err

    def lookup(token: str) -> int | None:
        tid = tok.convert_tokens_to_ids(token)
        return None if tid is None or tid == tok.unk_token_id else int(tid)

    name, eos_id = _eos(path, eos_token, tok.eos_token, lookup)

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]

    files = [p for p in path.iterdir() if p.is_file() and "token" in p.name]
    # len(tok) counts added tokens; a tokenizer whose ids go past it (rare) still fits.
    vocab = max(len(tok), eos_id + 1)
    return TextTokenizer(str(path), vocab, eos_id, name, encode, _file_digest(files))


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None, eos_token: str | None = None) -> TextTokenizer:
    """The tokenizer at ``path`` (a tokenizer.json or a folder), or bytes when ``path`` is None.

    Cached: the model builder and the data reader both ask for it.
    """
    if path is None:
        if eos_token is not None:
            raise DataError("--eos-token needs --tokenizer (byte tokens end documents with NUL)")
        return _bytes_tokenizer()
    p = Path(path)
    if p.is_dir():
        return _from_folder(p, eos_token)
    if p.is_file():
        return _from_json(p, eos_token)
    raise DataError(f"--tokenizer {path}: no such file or folder")
