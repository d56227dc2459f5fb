"""The folder a model is written into (``boost export --format hf`` / ``--format <layout>``,
:func:`boost_compiler.hf_io.write_folder`, :func:`boost_compiler.layouts.write`), checked
before anything is read or written.

Why: a reader decides what a folder is from the files it finds (``splora_config.json``
makes it SLTrain's, ``model_config.json`` Nanotron's, ``*.safetensors`` are all read), so a
second model written over a first one's folder would be read with the first one's stale
files and fail later, far from the cause ("missing keys"). A non-empty folder is therefore
refused unless the caller says ``overwrite``, and then the model files boost knows of
(:func:`model_files`) are removed first, so a read afterwards sees only the new model. A
training run's folders are never written, overwrite or not: a file added to a checkpoint's
step folder makes it fail its manifest check (unusable for ``--resume`` and export).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from .errors import HFFolderError

__all__ = [
    "check_output_folder",
    "clear_model_files",
    "model_files",
    "prepare_output_folder",
    "training_folder",
]

# Every config file a model folder of boost's formats holds (hf_io: config.json,
# generation_config.json; transformers' sharded index; layouts: model_config.json,
# splora_config.json).
CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                "model_config.json", "splora_config.json")  # fmt: skip
NANOTRON_TREE = "model"  # layouts/files.py: Nanotron's model/<name...>/model_<leaf>.safetensors
# A finished or cut-short checkpoint's own files and names (train/integrity.py METADATA,
# train/train_state.py STATE_FILE and STEP_DIR, train/run_folder.py LOCK_FILE): spelled out
# here so that writing a model folder does not import the trainer.
_CHECKPOINT_FILES = (".metadata", "train_state.json")
_STEP_DIR = re.compile(r"^step_\d+(\.tmp|\.stale)?$")
_RUN_LOCK = ".lock"


def training_folder(folder: Path) -> str | None:
    """Why ``folder`` belongs to a training run, or None: a checkpoint's step folder (one
    holding DCP's ``.metadata`` or ``train_state.json``), a folder inside one (a ``step_N``
    with ``.metadata``, or one holding ``train_state.json``), or a run
    folder (``--checkpoint-dir``: holding ``step_N`` checkpoints or the run's ``.lock``)."""
    folder = folder.absolute()
    for p in (folder, *folder.parents):
        held = [n for n in _CHECKPOINT_FILES if (p / n).is_file()]
        # Above the folder, a bare ``.metadata`` is any tool's file (a home folder's): only a
        # step folder's, or one beside a train_state.json, marks a checkpoint.
        if p != folder and held == [".metadata"] and not _STEP_DIR.match(p.name):
            held = []
        if held:
            where = "it" if p == folder else f"{p}, a folder above it,"
            return f"a training checkpoint's folder ({where} holds {', '.join(held)})"
    if folder.is_dir():
        steps = sorted(p.name for p in folder.iterdir() if _STEP_DIR.match(p.name) and p.is_dir())
        if steps or (folder / _RUN_LOCK).exists():
            held = (steps or [_RUN_LOCK])[0]
            return f"a training run's folder (--checkpoint-dir: it holds {held})"
    return None


def model_files(folder: Path) -> list[Path]:
    """The files of a model folder boost (or the layouts it writes) knows: its configs,
    ``*.safetensors`` and Nanotron's ``model/`` tree of safetensors."""
    found = [folder / n for n in CONFIG_FILES if (folder / n).is_file()]
    found += sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    tree = folder / NANOTRON_TREE
    if tree.is_dir():
        found += sorted(p for p in tree.rglob("*.safetensors") if p.is_file())
    return found


def check_output_folder(
    out: str | Path, *, overwrite: bool, error: type[HFFolderError] = HFFolderError
) -> Path:
    """Refuse, before anything is read or written, an output folder that cannot take a
    model: a file, a training run's folder, a non-empty folder without ``overwrite``.
    Changes nothing; returns the path."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise error(f"{folder}: a file, not a folder; a model is written as a folder: give "
                    "a folder's path (made if missing)")  # fmt: skip
    why = training_folder(folder)
    if why is not None:
        raise error(
            f"{folder}: {why}; writing a model there would leave the checkpoint unusable "
            "(its manifest lists every file it holds): give another output folder"
        )
    entries = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise error(
            f"{folder}: not empty (it holds {shown}); another model's files left there would "
            "be read with this one's: give an empty or new folder, or overwrite=True "
            "(boost export --overwrite) to replace the model files there"
        )
    return folder


def clear_model_files(folder: Path) -> list[Path]:
    """Remove :func:`model_files` (an earlier model's), and the ``model/`` tree's folders
    left empty; other files (a README, a tokenizer) stay. Returns what was removed."""
    removed = model_files(folder)
    for path in removed:
        path.unlink()
    tree = folder / NANOTRON_TREE
    if tree.is_dir():  # deepest first, so a parent empties once its children are gone
        for sub in sorted((p for p in tree.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            if not any(sub.iterdir()):
                sub.rmdir()
        if not any(tree.iterdir()):
            shutil.rmtree(tree)
    return removed


def prepare_output_folder(
    out: str | Path, *, overwrite: bool, error: type[HFFolderError] = HFFolderError
) -> Path:
    """:func:`check_output_folder`, then (with ``overwrite``) :func:`clear_model_files`:
    what a writer calls once the model to write has passed its own checks."""
    folder = check_output_folder(out, overwrite=overwrite, error=error)
    if folder.is_dir():
        clear_model_files(folder)
    return folder
