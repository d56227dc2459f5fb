"""Real processes on one run folder (issue 25, items 8 and 9): a second trainer is refused
by the folder's lock, naming the holder; the workers of a SIGKILLed torchrun stop. And
divergence at tp, pp and dp > 1 (item 10): every rank stops at the same step, or skips
the same steps.

Each trainer is the ``boost`` command itself, eager, the tiny model, throttled (``--throttle``)
so that it is still running when the test acts. The 60 s bound is a hang guard, not a
timing claim: a worker notices its launcher within about a second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
TRAIN = [str(BIN / "boost"), "train", "--no-compile", "--no-progress", "--batch", "2",
         "--seq", "16", "--log-every", "1"]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HANG_GUARD_S = 60.0
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads process states from /proc"
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _holder(ckdir: Path, procs: list[subprocess.Popen[bytes]], log: Path) -> dict[str, object]:
    """The lock holder ``ckdir/.lock`` names, once training has started."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        try:
            holder = json.loads((ckdir / ".lock").read_text())
            if (ckdir.parent / "metrics.jsonl").exists() and '"loss"' in (
                ckdir.parent / "metrics.jsonl"
            ).read_text():
                return holder
        except (FileNotFoundError, ValueError):
            pass
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"the trainer ended early:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no training step within {HANG_GUARD_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Pids the test started (directly or through torchrun): SIGKILLed if still running."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _start(cmd: list[str], log: Path, reaper: list[int]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    reaper.append(proc.pid)
    return proc


def _flags(root: Path, steps: int) -> list[str]:
    return ["--steps", str(steps), "--checkpoint-dir", str(root / "ckpt"),
            "--metrics", str(root / "metrics.jsonl")]  # fmt: skip


def test_a_second_trainer_on_one_folder_is_refused_naming_the_holder(
    tmp_path: Path, reaper: list[int]
) -> None:
    log = tmp_path / "first.log"
    first = _start([*TRAIN, *_flags(tmp_path, 100000), "--throttle", "0.2"], log, reaper)
    holder = _holder(tmp_path / "ckpt", [first], log)
    assert holder["pid"] == first.pid
    second = subprocess.run(
        [*TRAIN, *_flags(tmp_path, 2), "--resume"], env=ENV, capture_output=True,
        timeout=HANG_GUARD_S * 3,
    )  # fmt: skip
    err = " ".join(second.stderr.decode().split())
    assert second.returncode == 2, err[-3000:]
    assert "boost train: error:" in err and "is in use" in err, err[-3000:]
    assert f"pid {first.pid} on host {holder['host']}" in err, err[-3000:]
    assert first.poll() is None  # the first run was not disturbed
    first.kill()
    first.wait()


def test_workers_of_a_killed_torchrun_stop(tmp_path: Path, reaper: list[int]) -> None:
    log = tmp_path / "torchrun.log"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", *TRAIN,
           *_flags(tmp_path, 100000), "--save-every", "5", "--throttle", "0.2"]  # fmt: skip
    launcher = _start(cmd, log, reaper)
    worker = int(_holder(tmp_path / "ckpt", [launcher], log)["pid"])  # type: ignore[call-overload]
    reaper.append(worker)
    assert worker != launcher.pid
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + HANG_GUARD_S
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), f"worker {worker} still trains {HANG_GUARD_S} s after torchrun died"
    text = log.read_text()
    assert "launcher" in text and "is gone" in text, text[-3000:]
    # It stopped writing: nothing changes in the folder any more, and the lock is free.
    before = {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p != log}
    time.sleep(1.0)
    after = {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p != log}
    assert after == before
    assert not (tmp_path / "ckpt" / ".lock").exists()


def test_a_rank_that_raises_stops_every_rank_naming_its_error(
    tmp_path: Path, reaper: list[int]
) -> None:
    """Rank 1 raises at step 2 (``tests/train_fault_probe.py``); rank 0 waits in that step's
    collectives. Both end within the hang guard, and torchrun's summary names the error
    (the rank wrote it to torchrun's error file) under "Root Cause"."""
    probe = str(Path(__file__).with_name("train_fault_probe.py"))
    log = tmp_path / "torchrun.log"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", probe, "1", "2",
           *TRAIN[2:], "--tp", "2", *_flags(tmp_path, 1000)]  # fmt: skip
    start = time.monotonic()
    launcher = _start(cmd, log, reaper)
    try:
        code = launcher.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running after {HANG_GUARD_S} s:\n{log.read_text()[-3000:]}"
        ) from None
    text = log.read_text()
    assert code != 0 and time.monotonic() - start < HANG_GUARD_S
    cause = text[text.index("Root Cause") :]
    assert "rank      : 1" in cause, cause
    assert "RuntimeError: injected fault on rank 1 at step 2" in cause, cause


def test_ranks_seeded_differently_train_rank_0s_model_under_torchrun(tmp_path: Path) -> None:
    """The README's example run as written (no ``torch.manual_seed``): each rank built its
    own weights, and the parallelized model trains rank 0's (``tests/seed_probe.py``)."""
    probe = str(Path(__file__).with_name("seed_probe.py"))
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", probe]
    done = subprocess.run(cmd, env=ENV, capture_output=True, timeout=HANG_GUARD_S * 3)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    line = next(ln for ln in done.stdout.decode().splitlines() if ln.startswith("{"))
    res = json.loads(line)
    for tp, alone in zip(res["tp"], res["rank0_alone"], strict=True):
        assert abs(tp - alone) <= 1e-5 * abs(alone), res


# -- 10: divergence on every rank -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks(world: int, flags: list[str], root: Path, reaper: list[int]) -> list[tuple[int, str]]:
    """``world`` ``boost train`` processes with torchrun's environment variables, started
    by the test (not torchrun, which stops the other ranks once one exits: whether each
    rank reached its own end would then be a race). Every rank's exit code and output."""
    port, procs = _free_port(), []
    for rank in range(world):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "COLUMNS": "400"}  # fmt: skip
        log = root / f"rank{rank}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([*TRAIN, *flags], stdout=f, stderr=subprocess.STDOUT, env=env)
        reaper.append(proc.pid)
        procs.append((proc, log))
    deadline = time.monotonic() + 4 * HANG_GUARD_S  # 4 ranks start on 2 shared cores
    out = []
    for proc, log in procs:
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a rank that decided otherwise waits on its peers
            texts = "\n".join(f"--- {lg.name}\n{lg.read_text()[-2000:]}" for _, lg in procs)
            raise AssertionError(
                f"a rank still runs after {4 * HANG_GUARD_S} s:\n{texts}"
            ) from None
        out.append((code, " ".join(log.read_text().split())))  # unwrapped
    return out


def test_lr_1e6_stops_every_rank_at_the_same_step_tp2_dp2(
    tmp_path: Path, reaper: list[int]
) -> None:
    """--tp 2 --dp 2, eager: every rank ends by itself with DivergenceError (``boost train:
    error: step N: non-finite ...``, exit code 2) naming the same step."""
    ran = _ranks(4, ["--tp", "2", "--dp", "2", "--lr", "1e6", *_flags(tmp_path, 6)],
                 tmp_path, reaper)  # fmt: skip
    steps = []
    for rank, (code, text) in enumerate(ran):
        found = re.findall(
            r"boost train: error: step (\d+): non-finite .*? training diverged", text
        )
        assert code == 2 and len(found) == 1, (rank, code, text[-3000:])
        steps.append(int(found[0]))
    assert len(set(steps)) == 1, steps


def test_on_nonfinite_skip_skips_the_same_steps_on_every_rank_pp2_tp2(
    tmp_path: Path, reaper: list[int]
) -> None:
    """--pp 2 --tp 2, eager, ``--on-nonfinite skip``: every rank skips the same steps (each
    logs it), and all end after the last step, with a finite checkpoint."""
    from boost_compiler.train import checkpoint as ckpt

    flags = ["--pp", "2", "--tp", "2", "--lr", "1e6", "--on-nonfinite", "skip",
             *_flags(tmp_path, 4)]  # fmt: skip
    ran = _ranks(4, flags, tmp_path, reaper)
    skipped = []
    for rank, (code, text) in enumerate(ran):
        assert code == 0, (rank, code, text[-3000:])
        skipped.append(re.findall(r"step (\d+): non-finite [^:]*: optimizer step skipped", text))
    assert skipped[0] and all(s == skipped[0] for s in skipped), skipped
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    noted = [str(r["step"]) for r in records if r.get("event") == "nonfinite"]
    assert noted == skipped[0], (noted, skipped)
    sd, _ = ckpt.single_device_state_dict(tmp_path / "ckpt" / "step_4")
    assert all(bool(t.isfinite().all()) for t in sd.values() if t.is_floating_point())
