"""Real training data: files streamed through Hugging Face ``datasets``, tokenized, packed.

The token stream: the documents of the files in order (the files as given; a folder's
files sorted by path; a file's records in file order), each tokenized and followed by
one EOS token (:mod:`.tokenizer` says which), concatenated. Sequence ``i`` is tokens
``[i * seq, (i + 1) * seq)`` of it: a document's tail continues in the next sequence,
and no attention mask separates packed documents (the EOS token is the boundary the
model learns). At the end of the files the stream starts over (``epoch`` + 1).

Step ``s`` trains on the global batch of sequences ``[n, n + batch)``, ``n`` the
sequences consumed before it, and dp rank ``r`` keeps rows ``[r * b, (r + 1) * b)``,
``b = batch / dp``, as with the embedded corpus: disjoint rows, whose union is exactly
what a single rank trains on, so the loss of a step is the same at every (dp, tp)
layout. Why every rank reads the whole stream rather than a share of the files: the
position is then one global :class:`Position`, the same on every rank, and a checkpoint
saved at one dp resumes at another. Reading costs every rank the whole tokenization;
training costs far more per token.

Resume: a :class:`Position` (file, record in it, tokens of that record's document
already used, epoch, and the global document and sequence counts) is saved in the
checkpoint's ``train_state.json``; a resumed reader opens that file, skips the records
before (read, not tokenized) and drops the used tokens, so it continues with exactly
the next token, without replaying the corpus through the tokenizer.

Held-out split (``--eval-fraction f``): document ``d`` (its global index) is held out
iff ``floor((d + 1) f) > floor(d f)``: an even spread of a fraction ``f``, a pure
function of the index, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._logging import get_logger
from ..errors import DataError
from .tokenizer import TextTokenizer

log = get_logger(__name__)

# Extension -> the datasets builder that streams it.
SUFFIXES = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
# --txt-unit -> the text builder's sample_by: what one document of a .txt file is.
TXT_UNITS = {"file": "document", "paragraph": "paragraph", "line": "line"}
_ENCODE_CHUNK = 64  # documents per tokenizer call: batched encoding, bounded look-ahead

Split = Literal["train", "eval", "all"]


def resolve_files(paths: Sequence[str], flag: str = "--data") -> list[Path]:
    """The data files: each file as given, each folder's known files sorted (recursively)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            )  # fmt: skip
            known = [f for f in found if f.suffix.lower() in SUFFIXES]
            other = [str(f) for f in found if f.suffix.lower() not in SUFFIXES]
            if other:
                log.warning("%s %s: skipping %d file(s) that are not .txt, .jsonl or .parquet: %s",
                            flag, p, len(other), ", ".join(other[:5]))  # fmt: skip
            if not known:
                raise DataError(f"{flag} {p}: no .txt, .jsonl or .parquet files in this folder")
            empty = [f for f in known if f.stat().st_size == 0]
            if len(empty) == len(known):
                raise DataError(f"{flag} {p}: every data file in this folder is empty (0 bytes): "
                                f"{', '.join(map(str, empty[:5]))}")  # fmt: skip
            if empty:
                log.warning("%s %s: skipping %d empty file(s) (0 bytes): %s", flag, p, len(empty),
                            ", ".join(map(str, empty[:5])))  # fmt: skip
            out += [f for f in known if f not in empty]
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise DataError(
                    f"{flag} {p}: unknown extension {p.suffix or '(none)'!r}; {flag} takes .txt, "
                    ".jsonl and .parquet files, or folders of them"
                )
            if p.stat().st_size == 0:
                raise DataError(f"{flag} {p}: the file is empty (0 bytes): no documents to "
                                "read; give a file with text in it")  # fmt: skip
            out.append(p)
        else:
            raise DataError(f"{flag} {p}: {_not_a_file(p)}")
    return out


def _not_a_file(p: Path) -> str:
    """What ``p`` is when it is neither a regular file nor a folder: "no such file" is only
    true when nothing is there (``/dev/null`` exists, as a character device)."""
    import stat

    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        if p.is_symlink():
            return f"a link to {p.readlink()}, which does not exist"
        return "no such file or folder"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    kinds = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISSOCK: "a socket"}  # fmt: skip
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    return (f"{kind}, not a regular file or a folder: the data is read again each epoch and "
            "resumed by its position in the file, which needs a file on disk; give .txt, "
            ".jsonl or .parquet files, or folders of them")  # fmt: skip


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents (the same for the training and the eval files)."""

    text_field: str = "text"  # the jsonl / parquet column holding a document's text
    txt_unit: str = "file"  # one .txt document: the whole file, a paragraph, a line
    eval_fraction: float = 0.0  # held-out fraction of the --data documents


@dataclass(frozen=True)
class Position:
    """Where the next token of the stream comes from (JSON in the checkpoint)."""

    epoch: int = 0
    file: int = 0  # index into the run's file list
    record: int = 0  # record of that file whose document holds the next token
    offset: int = 0  # tokens of that document (EOS included) already consumed
    document: int = 0  # that record's global index over all files (the split's key)
    sequences: int = 0  # sequences consumed so far, all dp ranks together


def held_out(document: int, fraction: float) -> bool:
    """Whether document ``document`` is in the held-out split (see the module docstring)."""
    return fraction > 0 and math.floor((document + 1) * fraction) > math.floor(document * fraction)


def _records(path: Path, opts: ReadOptions, skip: int) -> Iterator[str]:
    """The texts of ``path``'s records from record ``skip`` on, streamed by ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"reading {path} needs the datasets package: pip install 'boost-compiler[train]'"
        ) from None
    builder = SUFFIXES[path.suffix.lower()]
    field = "text" if builder == "text" else opts.text_field
    kwargs: dict[str, Any] = {}
    if builder == "text":
        kwargs["sample_by"] = TXT_UNITS[opts.txt_unit]
    elif builder == "parquet":
        names = _parquet_columns(path)
        if field not in names:
            raise DataError(f"{path}: no column {field!r} (columns: {names}); name the text "
                            "column with --text-field")  # fmt: skip
        kwargs["columns"] = [field]  # read only the text, not the other columns
    try:
        rows = iter(datasets.load_dataset(
            builder, data_files=str(path), split="train", streaming=True, **kwargs))  # fmt: skip
    except Exception as err:  # datasets raises many kinds; the file is what the user needs
        raise DataError(f"{path}: datasets cannot open it as {builder}: {err}") from err
    index = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:
            raise DataError(_unreadable(path, builder, index, err)) from err
        if index >= skip:
            text = row.get(field)
            if text is None:
                raise DataError(
                    f"{path}: record {index} has no text field {field!r} (fields: "
                    f"{sorted(k for k, v in row.items() if v is not None)}); name it with "
                    "--text-field"
                )
            if not isinstance(text, str):
                raise DataError(f"{path}: record {index}: field {field!r} holds a "
                                f"{type(text).__name__}, not text")  # fmt: skip
            yield text
        index += 1


def _parquet_columns(path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(path).names)
    except (pa.ArrowException, OSError) as err:  # a file that is no parquet: ArrowInvalid
        raise DataError(f"{path}: not a readable parquet file ({err}); replace or remove it "
                        "from --data / --eval-data") from err  # fmt: skip


def _unreadable(path: Path, builder: str, index: int, err: Exception) -> str:
    """Why ``path`` stopped at record ``index``; for JSON lines, the line at fault.

    ``datasets`` parses a block of lines at a time, so its error comes at the block's first
    record, not at the line that failed: the line is found here, on this error path only.
    """
    if builder == "json":
        found = _bad_json_line(path)
        if found is not None:
            line, why = found
            return (f"{path}: line {line} is not a JSON object ({why}); fix or remove that "
                    "line")  # fmt: skip
    return f"{path}: cannot read record {index} as {builder}: {err}"


def _bad_json_line(path: Path) -> tuple[int, str] | None:
    """The first line (1-based) of a JSON-lines file that is neither blank nor a JSON object."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except ValueError as err:  # UnicodeDecodeError is a ValueError too
                return number, str(err)
            if not isinstance(value, dict):
                return number, f"a JSON {type(value).__name__}, not an object"
    return None


@dataclass(frozen=True)
class _Doc:
    epoch: int
    file: int
    record: int
    document: int
    tokens: list[int]  # the document's ids, then EOS


def documents(
    files: Sequence[Path], tok: TextTokenizer, opts: ReadOptions, start: Position,
    split: Split, repeat: bool,
) -> Iterator[_Doc]:  # fmt: skip
    """The tokenized documents of ``split`` from ``start`` on; forever if ``repeat``."""
    epoch, first_file, first_record, doc = start.epoch, start.file, start.record, start.document
    if first_file >= len(files):
        raise DataError(f"the data position names file {first_file}, but there are "
                        f"{len(files)} data file(s): the data changed since the checkpoint")  # fmt: skip
    while True:
        found = False
        for fi in range(first_file, len(files)):
            pending: list[tuple[int, int, str]] = []
            records = _records(files[fi], opts, first_record)
            for rec, text in enumerate(records, start=first_record):
                keep = held_out(doc, opts.eval_fraction) == (split == "eval") or split == "all"
                if keep:
                    pending.append((rec, doc, text))
                doc += 1
                if len(pending) == _ENCODE_CHUNK:
                    for d in _encoded(pending, epoch, fi, tok):
                        found = True
                        yield d
                    pending = []
            for d in _encoded(pending, epoch, fi, tok):
                found = True
                yield d
            first_record = 0
        if not repeat:
            return
        if not found and first_file == 0 and start.record == 0:  # a whole pass gave nothing
            raise DataError(f"no {split} documents in {len(files)} data file(s) "
                            f"({files[0]}{', ...' if len(files) > 1 else ''})")  # fmt: skip
        epoch, first_file, first_record, doc = epoch + 1, 0, 0, 0
        start = Position()
        log.info("data: end of the files, epoch %d begins", epoch)


def _encoded(pending: list[tuple[int, int, str]], epoch: int, fi: int, tok: TextTokenizer
             ) -> Iterator[_Doc]:  # fmt: skip
    if not pending:
        return
    for (rec, doc, _), ids in zip(pending, tok.encode([t for _, _, t in pending]), strict=True):
        if ids:  # an empty document adds nothing, not a lone EOS
            yield _Doc(epoch, fi, rec, doc, [*ids, tok.eos_id])


class Packer:
    """Cuts documents into ``seq``-token sequences; a resumed one starts at ``start``."""

    def __init__(self, docs: Iterator[_Doc], seq: int, start: Position) -> None:
        self._docs, self.seq, self._start = docs, seq, start
        self._doc: _Doc | None = None
        self._off = 0

    def _advance(self) -> bool:
        doc = next(self._docs, None)
        if doc is None:
            return False
        off, s = 0, self._start
        if self._doc is None and s.offset:  # the first document of a resumed reader
            if (doc.epoch, doc.file, doc.record) != (s.epoch, s.file, s.record) or (
                s.offset > len(doc.tokens)
            ):
                raise DataError(
                    f"the data position (file {s.file}, record {s.record}, token {s.offset}) "
                    f"does not fit the data: it changed since the checkpoint (or the tokenizer did)"
                )
            off = s.offset
        self._doc, self._off = doc, off
        return True

    def take(self, n: int) -> list[list[int]]:
        """The next ``n`` sequences (fewer, all complete, where a finite stream ends)."""
        out: list[list[int]] = []
        for _ in range(n):
            row: list[int] = []
            while len(row) < self.seq:
                if self._doc is None or self._off == len(self._doc.tokens):
                    if not self._advance():
                        return out
                assert self._doc is not None
                k = min(self.seq - len(row), len(self._doc.tokens) - self._off)
                row += self._doc.tokens[self._off : self._off + k]
                self._off += k
            out.append(row)
        return out

    def position(self) -> Position:
        d = self._doc
        return self._start if d is None else Position(d.epoch, d.file, d.record, self._off,
                                                      d.document)  # fmt: skip


def fingerprint(files: Sequence[Path], tok: TextTokenizer, opts: ReadOptions) -> str:
    """Recognises the same data on resume: the file list and sizes, tokenizer and options."""
    desc = {"files": [[str(f), f.stat().st_size] for f in files], "tokenizer": tok.digest,
            "eos": tok.eos_id, **asdict(opts)}  # fmt: skip
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def _label(files: Sequence[Path]) -> str:
    return f"{len(files)} file(s): {files[0]}{', ...' if len(files) > 1 else ''}"


class TokenStream:
    """The training batches of one dp rank, read from the packed stream (see the module)."""

    def __init__(self, files: Sequence[Path], tok: TextTokenizer, opts: ReadOptions,
                 batch: int, seq: int, dp_rank: int, dp: int) -> None:  # fmt: skip
        self.files, self.tok, self.opts = list(files), tok, opts
        self.batch, self.seq, self.dp_rank, self.dp = batch, seq, dp_rank, dp
        self.source = _label(self.files)
        self.digest = fingerprint(self.files, tok, opts)
        self._start = Position()
        self._packer: Packer | None = None
        self.sequences = 0

    def _open(self, start: Position) -> Packer:
        docs = documents(self.files, self.tok, self.opts, start, "train", repeat=True)
        return Packer(docs, self.seq, start)

    def _rows(self, seqs: list[list[int]]) -> torch.Tensor:
        return torch.tensor(seqs, dtype=torch.long).chunk(self.dp, dim=0)[self.dp_rank]

    def rows(self, step: int) -> torch.Tensor:
        """This dp rank's rows of the next global batch (the stream, not ``step``, decides)."""
        if self._packer is None:
            self._packer = self._open(self._start)
        seqs = self._packer.take(self.batch)
        self.sequences += self.batch
        return self._rows(seqs)

    def example(self) -> torch.Tensor:
        """The rows the next :meth:`rows` will return, without consuming them."""
        return self._rows(self._open(self.position()).take(self.batch))

    def position(self) -> Position:
        pos = self._start if self._packer is None else self._packer.position()
        return replace(pos, sequences=self.sequences)

    def state(self) -> dict[str, Any]:
        """The position to save (a collective: every rank checks all hold the same one)."""
        pos = asdict(self.position())
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, pos)
            if any(p != pos for p in every):
                raise DataError(f"ranks disagree on the data position: {every}")
        b = self.batch // self.dp
        ranks = [{"dp_rank": r, "next_rows": [pos["sequences"] + r * b, pos["sequences"] + (r + 1) * b]}
                 for r in range(self.dp)]  # fmt: skip
        return {"position": pos, "dp_ranks": ranks, **self.describe()}

    def describe(self) -> dict[str, Any]:
        return {"files": len(self.files), "options": asdict(self.opts), **self.tok.describe()}

    def restore(self, saved: dict[str, Any]) -> None:
        pos = saved.get("position")
        if pos is None:
            log.warning("the checkpoint holds no data position (it trained on another kind of "
                        "data): reading %s from its start", self.source)  # fmt: skip
            return
        try:
            self._start = Position(**{k: int(pos[k]) for k in asdict(Position()) if k in pos})
        except (TypeError, ValueError) as err:
            raise DataError(f"the checkpoint's data position {pos} is unreadable: {err}") from err
        self._packer = None
        self.sequences = self._start.sequences
        log.info("data: resuming at sequence %d (epoch %d, file %s, record %d, token %d)",
                 self.sequences, self._start.epoch, self.files[min(self._start.file,
                 len(self.files) - 1)], self._start.record, self._start.offset)  # fmt: skip


def eval_sequences(files: Sequence[Path], tok: TextTokenizer, opts: ReadOptions, split: Split,
                   n: int, seq: int) -> torch.Tensor:  # fmt: skip
    """The first ``n`` (or all, if fewer) packed sequences of ``split``: ``[k, seq]``."""
    docs = documents(files, tok, opts, Position(), split, repeat=False)
    seqs = Packer(docs, seq, Position()).take(n)
    return torch.tensor(seqs, dtype=torch.long).reshape(len(seqs), seq)
