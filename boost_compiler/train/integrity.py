"""Reading a checkpoint folder never runs code from it, and never loads changed bytes.

DCP writes its ``.metadata`` with :mod:`pickle`, and its ``FileSystemReader``
reads it back with ``pickle.load``: a folder from elsewhere could execute
anything. :class:`SafeReader` is DCP's own reader with one change, an
unpickler that resolves only the exact ``(module, name)`` pairs DCP's metadata
is made of (:data:`ALLOWED`: its dataclasses, ``torch.Size``, dtypes, a path);
tensor payloads already go through ``torch.load(weights_only=True)`` in DCP.
Every save also writes ``manifest.json`` (size and SHA-256 of every other file
of the step folder, ``.metadata`` included), and :func:`verify` checks it before
anything is read: the manifest must list exactly the folder's files, so a
truncated, flipped, added or unlisted file is an error naming the step folder
and the file instead of silently different weights.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointCorruptError, UnsafeCheckpointError

MANIFEST = "manifest.json"
METADATA = ".metadata"
_CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# Every global a DCP metadata pickle of a boost save names, as exact (module, name) pairs:
# what pickling the metadata of a real save shows (DCP's dataclasses and its memory-format
# enum, torch.Size, the layout helper torch.load itself allows, the save's PosixPath), plus
# the dtypes a saved tensor may have, each by its own name. Nothing else resolves: no other
# attribute of these modules, and never a dotted name (protocol 4 would look ``a.b`` up
# attribute by attribute, reaching e.g. ``metadata.os.system``).
_DCP = "torch.distributed.checkpoint.metadata"
_DTYPES = (
    "float32", "float16", "bfloat16", "float64",
    "uint8", "int8", "int16", "int32", "int64", "bool",
)  # fmt: skip
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        *(("torch", name) for name in _DTYPES),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise UnsafeCheckpointError(
                f"{self.where}: refuses to load {module}.{name}, which a DCP checkpoint's "
                "metadata never contains; this file could run code when unpickled. Do not "
                "load this folder unless you know who wrote it and why"
            )
        # One plain attribute of an already vetted module: not pickle's own lookup, which
        # would also remap old module names and walk dotted paths.
        return getattr(importlib.import_module(module), name)


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint folder ``path``, unpickled with the allowlist.

    Its storage entries must name plain files of ``path`` itself: those are the files
    :func:`verify` checks against the manifest, so a path out of the folder would load
    bytes that nothing checked.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    meta_path = path / METADATA
    try:
        data = meta_path.read_bytes()
    except OSError as exc:
        raise CheckpointCorruptError(f"{meta_path}: cannot be read ({exc})") from exc
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), meta_path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbled: pickle raises many kinds
        raise CheckpointCorruptError(
            f"{meta_path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{meta_path}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{meta_path}: storage_data is not a dict of file entries")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(name, str)
            or name in ("", ".", "..", MANIFEST, METADATA)
            or "/" in name
            or "\\" in name
        ):
            raise UnsafeCheckpointError(
                f"{meta_path}: a storage entry names {name!r}, not a payload file of this "
                "folder (a DCP save of boost writes names like __0_0.distcp); refusing to read "
                "outside the files the manifest checks"
            )
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` through :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError("per-rank DCP metadata files are not read by boost")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file in ``folder`` (call once all are written)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def _entries(manifest: Path) -> dict[str, tuple[int, str]]:
    """The manifest's ``{file name: (bytes, sha256)}``, or :class:`CheckpointCorruptError`
    naming what is malformed (an empty list checks nothing, so it is malformed too)."""
    try:
        raw = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{manifest}: missing or unreadable ({type(exc).__name__}: {exc}); the checkpoint "
            "cannot be checked"
        ) from exc
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointCorruptError(
            f"{manifest}: must be an object whose 'files' is a non-empty object of file name -> "
            f'{{"bytes", "sha256"}}; got {json.dumps(raw)[:80]}'
        )
    entries: dict[str, tuple[int, str]] = {}
    for name, want in files.items():
        size = want.get("bytes") if isinstance(want, dict) else None
        digest = want.get("sha256") if isinstance(want, dict) else None
        if (
            type(size) is not int
            or size < 0
            or not isinstance(digest, str)
            or not _SHA256.match(digest)
            or name in ("", ".", "..", MANIFEST)
            or "/" in name
            or "\\" in name
        ):
            raise CheckpointCorruptError(
                f"{manifest}: files[{name!r}] must name a file of the folder and hold an "
                f'integer "bytes" >= 0 and a hex "sha256"; got {json.dumps(want)[:80]}'
            )
        entries[name] = (size, digest)
    return entries


def verify(folder: Path) -> None:
    """Raise :class:`CheckpointCorruptError` unless the manifest lists exactly the folder's
    files (``.metadata`` included, itself excepted) and every one matches it."""
    manifest = folder / MANIFEST
    entries = _entries(manifest)
    if METADATA not in entries:
        raise CheckpointCorruptError(
            f"{manifest}: does not list {METADATA}, whose pickle says which bytes are loaded; "
            "every file of a boost save is listed"
        )
    present = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    unlisted = [name for name in present if name not in entries]
    if unlisted:
        raise CheckpointCorruptError(
            f"{folder}: holds {unlisted[:6]}, which {MANIFEST} does not list (added after the "
            "save, or the manifest was cut); a boost save lists every file it writes"
        )
    for name, (want_bytes, want_sha) in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: listed in the manifest but missing")
        size = path.stat().st_size
        if size != want_bytes:
            raise CheckpointCorruptError(
                f"{path}: {size} bytes, the manifest says {want_bytes} (truncated or replaced)"
            )
        if _digest(path) != want_sha:
            raise CheckpointCorruptError(
                f"{path}: contents differ from the manifest's checksum (corrupted on disk or edited)"
            )
