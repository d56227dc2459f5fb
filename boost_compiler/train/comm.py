"""Process groups that give up on a lost peer, and errors that name the rank that was lost.

Why this module: a gloo or NCCL collective waits for every peer of its group, and
the wait is bounded only by the group's timeout. torch's default is 30 minutes, and
the groups ``init_device_mesh`` creates take torch's default whatever the default
group was given (``new_group`` does not inherit it; the ``(pp, dp, tp)`` groups are
where a pipeline spends its waits). So the run's groups are made here, every one
with ``--comm-timeout``: a rank whose peer died mid-step gets an error within that
time (gloo usually raises at once, "Connection reset by peer"; a peer that is alive
but stuck is only found by the timeout) instead of hanging.

The error a rank then sees says nothing about *which* rank was lost. Every rank
therefore records each peer's host and pid when the run starts (one all-gather),
and :func:`lost_rank_errors` turns a failed collective into a
:class:`~boost_compiler.errors.RankFailureError` that names the peers on this host
whose process is gone. torchrun's elastic agent reports the failed rank too (and
stops the other workers); this covers launches without it.

The launcher itself can die too (torchrun SIGKILLed, its node agent OOM-killed): its
workers are then re-parented and would train on, unwatched, writing into the run
folder for as long as the run lasts. :class:`LauncherWatch` notices the parent change
and stops the rank at the next step (or exits it after a grace period).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._logging import get_logger
from ..errors import BoostError, LauncherLostError, RankFailureError

log = get_logger(__name__)

__all__ = [
    "LauncherWatch",
    "Peers",
    "device_mesh",
    "group_over",
    "lost_rank_errors",
    "timeout_of",
    "watch_launcher",
]

# Words of the errors gloo, NCCL and c10d raise when a peer is gone or late (gloo's
# name their source file under gloo/; "pair closure" follows a gloo timeout). Specific
# on purpose: any other error passes through lost_rank_errors unchanged.
_COMM_WORDS = ("gloo", "nccl", "c10d", "connection reset", "connection closed",
               "connection refused", "broken pipe", "timed out waiting", "pair closure")  # fmt: skip


def timeout_of(seconds: float | None) -> datetime.timedelta | None:
    """``--comm-timeout`` as the ``timedelta`` c10d takes (None: torch's default)."""
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def device_mesh(
    device_type: str,
    shape: Sequence[int],
    names: Sequence[str],
    timeout: datetime.timedelta | None,
) -> Any:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)`` whose groups time out.

    Every group along every dim is created by every rank in the same order (as
    ``new_group`` requires), each with ``timeout``; the mesh is built from the groups
    this rank belongs to. The same rank layout as ``init_device_mesh`` (row-major).
    """
    from torch.distributed.device_mesh import DeviceMesh

    shape = tuple(int(s) for s in shape)
    ranks = torch.arange(dist.get_world_size()).reshape(shape)
    mine = [_groups_along(ranks, (d,), timeout) for d in range(len(shape))]
    return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=tuple(names))


def group_over(mesh: Any, dims: Sequence[str], timeout: datetime.timedelta | None) -> Any:
    """The group of this rank's mesh neighbours along ``dims`` together (``mesh[dims]._flatten()``,
    with ``timeout``). A collective over the whole world: every rank calls it."""
    names = list(mesh.mesh_dim_names)
    return _groups_along(mesh.mesh, tuple(names.index(d) for d in dims), timeout)


def _groups_along(ranks: torch.Tensor, dims: tuple[int, ...], timeout: Any) -> Any:
    """Create the groups that vary along ``dims`` of the rank grid; return this rank's."""
    rest = [d for d in range(ranks.dim()) if d not in dims]
    size = 1
    for d in dims:
        size *= ranks.shape[d]
    rows = ranks.permute(*rest, *dims).reshape(-1, size)
    me, mine = dist.get_rank(), None
    for row in rows.tolist():
        group = dist.new_group(row, timeout=timeout)
        if me in row:
            mine = group
    return mine


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class Peers:
    """Every rank's host and pid, recorded while all of them are alive."""

    peers: tuple[Peer, ...]

    @classmethod
    def gather(cls) -> Peers:
        """A collective over the default group (every rank calls it once, at the start)."""
        me = (socket.gethostname(), os.getpid())
        table: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(table, me)
        return cls(tuple(Peer(r, host, pid) for r, (host, pid) in enumerate(table)))

    def lost(self) -> list[tuple[Peer, str]]:
        """Peers on this host that cannot take part in a collective, with why."""
        host, me = socket.gethostname(), dist.get_rank()
        return [(p, why) for p in self.peers
                if p.host == host and p.rank != me and (why := _not_running(p.pid))]  # fmt: skip


def _not_running(pid: int) -> str | None:
    """Why process ``pid`` cannot answer its peers, or None while it runs (or cannot be seen)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the state follows the parenthesised command name, which may hold spaces
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "exited (killed or crashed)"
    except OSError:  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited (killed or crashed)"
        except PermissionError:
            return None
        return None
    if state in ("Z", "X"):  # a zombie: dead, its launcher has not reaped it yet
        return "exited (killed or crashed)"
    if state in ("T", "t"):
        return "is stopped (SIGSTOP, or held by a debugger)"
    return None


def _is_comm_error(exc: BaseException | None, depth: int = 0) -> bool:
    """A collective's failure, also when wrapped (torch.distributed.pipelining re-raises a
    stage's error as a new ``RuntimeError`` from it)."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    if isinstance(exc, RuntimeError) and any(w in text for w in _COMM_WORDS):
        return True
    return _is_comm_error(exc.__cause__ or exc.__context__, depth + 1)


# A killed peer's sockets close while the kernel tears the process down, a moment before
# /proc shows it exited: a rank whose collective failed that instant looks that long.
_SETTLE_S = 3.0


def _lost_after(peers: Peers, settle_s: float) -> list[tuple[Peer, str]]:
    deadline = time.monotonic() + settle_s
    while not (lost := peers.lost()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return lost


@contextlib.contextmanager
def lost_rank_errors(
    timeout_s: float,
    advice: str = "rerun with --resume to continue from the last complete checkpoint",
) -> Iterator[Peers]:
    """Record the peers (a collective); re-raise a failed collective as a
    :class:`RankFailureError` naming the lost rank(s). Other errors pass unchanged."""
    peers = Peers.gather()
    try:
        yield peers
    except BoostError:
        raise
    except Exception as exc:
        comm_error = _is_comm_error(exc)
        lost = _lost_after(peers, _SETTLE_S) if comm_error else peers.lost()
        if not lost and not comm_error:
            raise
        text = str(exc).strip()
        cause = text.splitlines()[0][:300] if text else type(exc).__name__
        if lost:
            why = "; ".join(f"rank {p.rank} (pid {p.pid}) {state}" for p, state in lost)
        else:
            why = (f"a peer did not answer within --comm-timeout {timeout_s:g} s or closed its "
                   "connection, and every rank on this host still runs: the lost rank is on "
                   "another host or hangs (the launcher's log names it)")  # fmt: skip
        msg = f"rank {dist.get_rank()}: a collective failed: {why}. Stopping; {advice} ({cause})"
        log.error("%s", msg)
        raise RankFailureError(msg) from exc


# Exit status of a rank that did not stop within the grace period after losing its launcher.
LAUNCHER_LOST_EXIT = 3


class LauncherWatch:
    """A daemon thread that polls ``os.getppid()``: a change means the launcher is gone.

    Polling, not ``prctl(PR_SET_PDEATHSIG)``: that signal follows the parent *thread* that
    forked the rank, is Linux-only, and kills without letting a line of metrics finish.
    Here the loop calls :meth:`check` before each step and leaves by
    :class:`LauncherLostError`; a rank stuck elsewhere (a collective with a peer that
    stopped first, a long save) is exited after ``grace_s``, the kernel then dropping
    its run-folder lock.
    """

    def __init__(self, parent: int, poll_s: float = 1.0, grace_s: float = 30.0) -> None:
        self.parent, self.poll_s, self.grace_s = parent, poll_s, grace_s
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="boost-launcher-watch",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if os.getppid() == self.parent:
                continue
            self._lost.set()
            log.error("%s: stopping at the end of this step", self._message())
            if not self._stop.wait(self.grace_s):
                log.error("%s: the rank did not stop within %g s, exiting", self._message(),
                          self.grace_s)  # fmt: skip
                sys.stderr.flush()
                os._exit(LAUNCHER_LOST_EXIT)
            return

    def _message(self) -> str:
        rank = os.environ.get("RANK", "?")
        return (f"rank {rank} (pid {os.getpid()}): its launcher (pid {self.parent}) is gone, "
                "and a rank without one would train on unwatched")  # fmt: skip

    def check(self) -> None:
        """Raise :class:`LauncherLostError` once the launcher is gone."""
        if self._lost.is_set():
            raise LauncherLostError(
                f"{self._message()}; stopped. Start the run again (the same command with "
                "--resume continues from the last complete checkpoint)"
            )

    def stop(self) -> None:
        self._stop.set()


def watch_launcher() -> LauncherWatch | None:
    """A :class:`LauncherWatch` for a rank a launcher started (``RANK`` in the environment).

    A lone process is not watched: ``nohup boost train &`` outliving its shell is intended.
    Nor is a rank already adopted by init (pid 1): there is no launcher left to lose.
    """
    parent = os.getppid()
    if "RANK" not in os.environ or parent == 1:
        return None
    return LauncherWatch(parent)
