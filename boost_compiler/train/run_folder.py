"""The run folder's guard: one run per folder, checked before any work (:func:`claim_run_folder`).

Why: a run folder is one run's history. Before any work, rank 0 checks that
``--checkpoint-dir`` and ``--metrics`` can be written (a save that fails at step 1000
loses 1000 steps), takes an OS lock on ``DIR/.lock`` for the whole run (two trainers
writing one folder interleave their checkpoints and metrics), and refuses what would
mix or destroy another run: a fresh run into a used folder (``--overwrite`` clears it),
a ``--resume`` with no intact checkpoint (``--resume-or-start`` moves the unusable step
folders and the old metrics into ``DIR/corrupt/``, never deleting them).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .._logging import get_logger
from ..errors import NoUsableCheckpointError, RunFolderError, RunLockedError
from .config import TrainConfig

log = get_logger(__name__)

LOCK_FILE = ".lock"
ASIDE = "corrupt"  # DIR/corrupt/: what --resume-or-start and a fallback set aside
_STEP = re.compile(r"^step_(\d+)$")
_STEP_ANY = re.compile(r"^step_\d+(\.tmp|\.stale)?$")  # finished, cut short, being replaced


class RunLock:
    """An exclusive ``flock`` on ``DIR/.lock``, holding its owner's host and pid.

    The kernel drops the lock when the process dies, however it dies, so a stale file
    never blocks a later run. :meth:`release` removes the file while still holding the
    lock; :meth:`acquire` therefore re-checks, once locked, that the file it locked is
    still the one at the path (else a third trainer could lock a fresh file beside it).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, folder: Path) -> RunLock:
        path = folder / LOCK_FILE
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise RunFolderError(
                    f"--checkpoint-dir {folder}: cannot create {path} ({err.strerror}): the "
                    "folder must be writable"
                ) from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip()
                os.close(fd)
                raise RunLockedError(_locked_message(folder, holder)) from None
            except OSError as err:  # ENOSYS, ENOLCK, EOPNOTSUPP: a filesystem without flock
                if os.fstat(fd).st_size == 0:  # the empty file just made: leave nothing behind
                    path.unlink(missing_ok=True)
                os.close(fd)
                name = errno.errorcode.get(err.errno or 0, str(err.errno))
                raise RunFolderError(
                    f"--checkpoint-dir {folder}: cannot lock {path} ({name}: {err.strerror}): "
                    "its filesystem does not support flock (some network, FUSE or container "
                    "filesystems), and without the lock two trainers could write one folder: "
                    "give a --checkpoint-dir on a local filesystem"
                ) from err
            if _same_file(fd, path):
                break
            os.close(fd)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(record) + "\n").encode())
        return cls(path, fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            self.path.unlink()
        except OSError:
            pass  # the folder went away, or was made read-only: the lock still ends below
        os.close(self._fd)
        self._fd = -1


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _locked_message(folder: Path, holder: str) -> str:
    try:
        who = json.loads(holder)
        name = f"pid {who['pid']} on host {who['host']} (since {who.get('since', '?')})"
    except (ValueError, KeyError, TypeError):
        name = f"another process ({holder or 'no holder recorded yet'})"
    return (
        f"--checkpoint-dir {folder} is in use: {name} holds {folder / LOCK_FILE}. Two trainers "
        "in one folder would interleave their checkpoints and metrics: wait for that run to "
        "end (or stop it), or give another --checkpoint-dir"
    )


@dataclass
class RunClaim:
    """Rank 0's claim on the run folder: its lock, and the checkpoint to resume from."""

    lock: RunLock | None
    resume_from: Path | None
    skipped: list[str]


def claim_run_folder(cfg: TrainConfig) -> RunClaim:
    """Check, lock and prepare the run's folder and metrics file (rank 0, before setup)."""
    metrics = _metrics_path(cfg)
    lock = None
    if cfg.checkpoint_dir:
        folder = _make_folder(Path(cfg.checkpoint_dir), "--checkpoint-dir")
        lock = RunLock.acquire(folder)
    try:
        found, skipped = None, []
        if cfg.resume or cfg.resume_or_start:
            found, skipped = _resolve_resume(cfg, metrics)
        else:
            _refuse_or_clear(cfg, metrics)
        _check_writable(metrics)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return RunClaim(lock, found, skipped)


def _metrics_path(cfg: TrainConfig) -> Path | None:
    if not cfg.metrics:
        return None
    path = Path(cfg.metrics)
    if path.is_dir():
        raise RunFolderError(
            f"--metrics {path} is a folder: --metrics names the JSON-lines file, e.g. "
            f"--metrics {path / 'metrics.jsonl'}"
        )
    _make_folder(path.parent, "--metrics")
    return path


def _make_folder(path: Path, flag: str) -> Path:
    """``path`` made (with its parents), or :class:`RunFolderError` naming what is in the way."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise RunFolderError(
            f"{flag} {path}: {blocker} is a file, not a folder; give a path whose folders "
            "can be made there"
        ) from err
    except OSError as err:
        raise RunFolderError(f"{flag} {path}: cannot make the folder ({err.strerror})") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunFolderError(f"{flag} {path}: the folder is not writable by this user")
    return path


def _check_writable(metrics: Path | None) -> None:
    if metrics is None:
        return
    try:
        with open(metrics, "a"):
            pass
    except OSError as err:
        raise RunFolderError(f"--metrics {metrics}: cannot write it ({err.strerror})") from err


def _has_records(metrics: Path | None) -> bool:
    return metrics is not None and metrics.is_file() and bool(metrics.read_text().strip())


def _step_folders(cfg: TrainConfig, pattern: re.Pattern[str] = _STEP) -> list[Path]:
    root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if root is None or not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if pattern.match(p.name) and p.is_dir())


def _refuse_or_clear(cfg: TrainConfig, metrics: Path | None) -> None:
    """A fresh run: refuse a used folder (another run's steps, metrics) unless ``--overwrite``."""
    used = _step_folders(cfg, _STEP_ANY)
    records = _has_records(metrics)
    if not used and not records:
        return
    what = ([f"--checkpoint-dir {cfg.checkpoint_dir} holds "
             f"{', '.join(p.name for p in used[:4])}{', ...' if len(used) > 4 else ''}"]
            if used else []) + ([f"--metrics {metrics} holds records"] if records else [])  # fmt: skip
    if not cfg.overwrite:
        raise RunFolderError(
            f"{' and '.join(what)} of an earlier run; a fresh run would mix with it: add "
            "--resume to continue it, --overwrite to delete it and start over, or choose "
            "another --checkpoint-dir / --metrics"
        )
    for path in used:
        shutil.rmtree(path)
    if metrics is not None:
        metrics.write_text("")
    log.warning("--overwrite: deleted the earlier run's %s", " and ".join(what))


def _resolve_resume(cfg: TrainConfig, metrics: Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint ``--resume`` continues from, the reasons newer ones were skipped; the
    skipped folders are set aside, so that the resumed run's saves never overwrite them."""
    from . import checkpoint as ckpt

    root = Path(str(cfg.checkpoint_dir))
    found, skipped = ckpt.latest_valid(root)
    newer = [p for p in _step_folders(cfg) if found is None or _step(p) > _step(found)]
    records = _has_records(metrics)
    if found is None and (newer or records) and not cfg.resume_or_start:
        raise NoUsableCheckpointError(_nothing_usable(root, newer, skipped, metrics, records))
    if newer:
        moved = _set_aside(root, newer)
        log.warning("set aside %d unusable checkpoint(s) into %s: %s", len(moved),
                    root / ASIDE, ", ".join(p.name for p in moved))  # fmt: skip
    if found is None and records and metrics is not None:
        (kept,) = _set_aside(root, [metrics])
        log.warning("--resume-or-start: the earlier metrics %s moved to %s", metrics, kept)
    if found is None:
        log.warning("%s: no intact checkpoint in %s, starting at step 0",
                    "--resume-or-start" if cfg.resume_or_start else "--resume", root)  # fmt: skip
    return found, skipped


def _step(path: Path) -> int:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else -1


def _nothing_usable(
    root: Path, newer: list[Path], skipped: list[str], metrics: Path | None, records: bool
) -> str:
    if newer:
        why = "; ".join(skipped) or ", ".join(p.name for p in newer)
        head = f"--resume: no intact checkpoint in {root}: skipped {len(newer)} ({why})"
    else:
        head = (f"--resume: {root} holds no checkpoint, but --metrics {metrics} holds records "
                "of an earlier run")  # fmt: skip
    return (
        f"{head}. Nothing was changed. Pass --resume-or-start to start over at step 0 (the "
        f"unusable folders and the old metrics are moved into {root / ASIDE}/, not deleted), "
        "or restore an intact checkpoint"
    )


def _set_aside(root: Path, paths: list[Path]) -> list[Path]:
    """Move ``paths`` into ``root/corrupt/``, each under a name not taken there yet."""
    aside = root / ASIDE
    aside.mkdir(exist_ok=True)
    moved = []
    for path in paths:
        target, n = aside / path.name, 1
        while target.exists():
            target, n = aside / f"{path.name}.{n}", n + 1
        shutil.move(str(path), str(target))
        moved.append(target)
    return moved
