"""Reading a checkpoint folder never runs code from it, and never loads changed bytes.

DCP writes its ``.metadata`` with :mod:`pickle`, and its ``FileSystemReader``
reads it back with ``pickle.load``: a folder from elsewhere could execute
anything. :class:`SafeReader` is DCP's own reader with one change, an
unpickler that resolves only the globals DCP's metadata is made of (its
dataclasses, ``torch.Size``, dtypes, paths); tensor payloads already go
through ``torch.load(weights_only=True)`` in DCP. Every save also writes
``manifest.json`` (size and SHA-256 of each file), and :func:`verify` checks
it before anything is read, so a truncated or flipped payload is an error
naming the step folder and the file instead of silently different weights.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointCorruptError, UnsafeCheckpointError

MANIFEST = "manifest.json"
_CHUNK = 1 << 20

# (module, name) pairs DCP's metadata pickles may name: DCP's dataclasses and enums,
# torch.Size, dtypes, the layout helper torch.load itself allows, and paths.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module in _DCP_MODULES and not name.startswith("__")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.where}: refuses to load {module}.{name}, which a DCP checkpoint's "
            "metadata never contains; this file could run code when unpickled. Do not "
            "load this folder unless you know who wrote it and why"
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint folder ``path``, unpickled with the allowlist."""
    meta_path = path / ".metadata"
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


def verify(folder: Path) -> None:
    """Raise :class:`CheckpointCorruptError` unless every file matches the manifest."""
    manifest = folder / MANIFEST
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointCorruptError(
            f"{manifest}: missing or unreadable ({type(exc).__name__}); the checkpoint "
            "cannot be checked"
        ) from exc
    for name, want in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: listed in the manifest but missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointCorruptError(
                f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or replaced)"
            )
        if _digest(path) != want["sha256"]:
            raise CheckpointCorruptError(
                f"{path}: contents differ from the manifest's checksum (corrupted on disk or edited)"
            )
