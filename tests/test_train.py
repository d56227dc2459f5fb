"""End-to-end training (issue 9): parity across (dp, tp), resharded resume, crash/resume,
global-norm clipping, export. CPU, gloo, eager (``--no-compile``), the tiny CoLA-LLaMA.

Multi-process runs are ranks of ``examples/train.py`` with torchrun's environment
variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT), started by the test so that it can
SIGKILL one rank: forks of a server that imported torch once, and for the rerun after
the kill real ``python examples/train.py`` processes. Single-process runs call
:func:`train` in-process.
Every run is started once by the module fixture, independent runs concurrently.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from boost_compiler.train import (
    GradSlot,
    TrainConfig,
    clip_grad_norm_,
    latest,
    lr_at,
    read_metrics,
    train,
)
from boost_compiler.train.config import add_arguments, from_args
from boost_compiler.train.setup import build_model

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
COMMON = {"steps": STEPS, "batch": 4, "seq": 32, "warmup": 2, "clip": 0.5, "save_every": 3}
RTOL = 1e-4
TIMEOUT = 900  # seconds per launch: generous, the CI cores are shared


def _flags(compile: bool = False, **kw: Any) -> list[str]:
    out = ["--compile" if compile else "--no-compile", "--no-progress", "--log-every", "100"]
    for k, v in {**COMMON, **kw}.items():
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [flag, str(v)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, argv: list[str], log: str) -> None:
    """One rank, in a child of the forkserver (torch already imported): examples/train.py's main."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    from examples.train import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Ranks start as forks of one server process that imported torch and the training code
# once: on 2 shared cores the imports are a third of a short run's CPU time.
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "boost_compiler.train.loop", "examples.train"])


@dataclass
class Launch:
    """``world`` ranks of examples/train.py, with torchrun's environment variables."""

    procs: list[Any]
    logs: list[Path]

    @classmethod
    def start(cls, world: int, logdir: Path, *, script: bool = False, **kw: Any) -> Launch:
        """Forked ranks, or with ``script`` real ``python examples/train.py`` processes."""
        port = _free_port()
        logdir.mkdir(parents=True, exist_ok=True)
        procs, logs = [], []
        for rank in range(world):
            log = logdir / f"rank{rank}.log"
            logs.append(log)
            if not script:
                proc = _CTX.Process(
                    target=_rank_main, args=(rank, world, port, _flags(**kw), str(log))
                )
                proc.start()
                procs.append(proc)
                continue
            env = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT),
            }  # fmt: skip
            with open(log, "ab") as f:
                cmd = [sys.executable, str(ROOT / "examples" / "train.py"), *_flags(**kw)]
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f))
        return cls(procs, logs)

    def wait(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        for p in self.procs:
            remaining = max(1.0, deadline - time.monotonic())
            if isinstance(p, subprocess.Popen):
                try:
                    p.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    self.kill()
            else:
                p.join(remaining)
                if p.exitcode is None:
                    self.kill()
        bad = [r for r in range(len(self.procs)) if self.returncode(r) != 0]
        if bad:
            tails = "\n".join(f"--- rank {r}:\n{self.logs[r].read_text()[-3000:]}" for r in bad)
            raise AssertionError(f"ranks {bad} failed:\n{tails}")

    def returncode(self, rank: int) -> int | None:
        p = self.procs[rank]
        return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode

    def running(self) -> bool:
        return all(self.returncode(r) is None for r in range(len(self.procs)))

    def sigkill(self, rank: int) -> None:
        p = self.procs[rank]
        if self.returncode(rank) is None:
            os.kill(p.pid, signal.SIGKILL)
        if isinstance(p, subprocess.Popen):
            p.wait()
        else:
            p.join()

    def kill(self) -> None:
        for r in range(len(self.procs)):
            self.sigkill(r)


def _in_process(**kw: Any) -> Any:
    cfg = TrainConfig(**{**COMMON, **kw}, compile=False, progress=False, log_every=100)
    return train(cfg)


def _losses(path: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(path).items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _max_rel(got: dict[int, float], want: dict[int, float]) -> float:
    assert got and set(got) <= set(want), (sorted(got), sorted(want))
    return max(_rel(got[s], want[s]) for s in got)


def _kill_after_checkpoint(run: Launch, ckdir: Path, metrics: Path) -> int:
    """SIGKILL rank 1 once step_3 is complete and a later step ran; then the rest (torchrun's job)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done = latest(ckdir)
        if done is not None and metrics.exists() and max(read_metrics(metrics), default=-1) >= 3:
            break
        if not run.running():
            tails = "\n".join(f"--- rank {r}:\n{log.read_text()[-3000:]}" for r, log in
                              enumerate(run.logs))  # fmt: skip
            raise AssertionError(f"the run ended before it could be killed:\n{tails}")
        time.sleep(0.05)
    else:
        run.kill()
        raise AssertionError("no checkpoint appeared")
    run.sigkill(1)
    time.sleep(1.0)  # rank 0 is now stuck in a collective with a dead peer
    run.kill()
    assert run.returncode(0) != 0 and run.returncode(1) == -signal.SIGKILL
    lost = max(read_metrics(metrics))
    return lost


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("train")
    out: dict[str, Any] = {"tmp": tmp}
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    # Phase 1, concurrently: tp=2, dp=2, dp=2 x tp=2, a tp=2 run that will be killed;
    # then the single-process run in this process.
    launches = {
        name: Launch.start(world, tmp / name, checkpoint_dir=tmp / name / "ckpt",
                           metrics=tmp / name / "metrics.jsonl", **kw)
        for name, world, kw in (("tp2", 2, {"tp": 2}), ("dp2", 2, {"dp": 2}),
                                ("dp2tp2", 4, {"dp": 2, "tp": 2}),
                                ("kill", 2, {"tp": 2, "throttle": 0.5}))
    }  # fmt: skip
    # The kill first: polled from here, it must not wait behind the in-process run
    # (on a loaded machine the throttled run could otherwise end before it is killed).
    out["killed_after"] = _kill_after_checkpoint(
        launches["kill"], tmp / "kill" / "ckpt", tmp / "kill" / "metrics.jsonl"
    )
    out["single"] = _in_process(
        checkpoint_dir=str(tmp / "single" / "ckpt"), metrics=str(tmp / "single" / "metrics.jsonl")
    )
    timings["single"] = time.monotonic() - t0
    out["killed_latest"] = killed = latest(tmp / "kill" / "ckpt")
    assert killed is not None
    # What a crash in the middle of the next save leaves: a partial step_N.tmp.
    partial = tmp / "kill" / "ckpt" / f"step_{int(killed.name.removeprefix('step_')) + 3}.tmp"
    partial.mkdir(exist_ok=True)
    (partial / "__0_0.distcp").write_bytes(b"partial")
    out["partial"] = partial
    # The same command again, with --resume, as real processes of the script.
    rerun = Launch.start(
        2, tmp / "kill", script=True, tp=2, resume=True,
        checkpoint_dir=tmp / "kill" / "ckpt", metrics=tmp / "kill" / "metrics.jsonl",
    )  # fmt: skip
    launches["tp2"].wait()
    timings["tp2"] = time.monotonic() - t0
    # Phase 2: resume the tp=2 run's step-3 checkpoint at tp=1 (here) and at dp=2.
    for name in ("r_tp1", "r_dp2"):
        (tmp / name / "ckpt").mkdir(parents=True)
        shutil.copytree(tmp / "tp2" / "ckpt" / "step_3", tmp / name / "ckpt" / "step_3")
    r_dp2 = Launch.start(2, tmp / "r_dp2", dp=2, resume=True, checkpoint_dir=tmp / "r_dp2" / "ckpt",
                         metrics=tmp / "r_dp2" / "metrics.jsonl")  # fmt: skip
    out["r_tp1"] = _in_process(
        resume=True, checkpoint_dir=str(tmp / "r_tp1" / "ckpt"),
        metrics=str(tmp / "r_tp1" / "metrics.jsonl"),
    )  # fmt: skip
    for name, launch in (("dp2", launches["dp2"]), ("dp2tp2", launches["dp2tp2"]),
                         ("kill_rerun", rerun), ("r_dp2", r_dp2)):  # fmt: skip
        launch.wait()
        timings[name] = time.monotonic() - t0
    out["timings"] = timings
    print("run timings (s, since start):", {k: round(v, 1) for k, v in timings.items()})
    return out


def test_loss_parity_across_layouts(runs: dict[str, Any]) -> None:
    """Same global batch, fp32: the first 10 losses agree at every (dp, tp) within 1e-4."""
    tmp = runs["tmp"]
    single = _losses(tmp / "single" / "metrics.jsonl")
    assert sorted(single) == list(range(STEPS))
    assert single == pytest.approx(runs["single"].losses, rel=0, abs=0)
    assert single[STEPS - 1] < single[0]  # it trains
    errs = {}
    for name in ("tp2", "dp2", "dp2tp2"):
        got = _losses(tmp / name / "metrics.jsonl")
        assert sorted(got) == list(range(STEPS)), name
        errs[name] = _max_rel(got, single)
    print("max relative loss error vs one process:", errs)
    assert max(errs.values()) < RTOL, errs


def test_metrics_record_collective_bytes(runs: dict[str, Any]) -> None:
    recs = read_metrics(runs["tmp"] / "dp2tp2" / "metrics.jsonl")
    first = recs[0]
    assert first["tp_collective_bytes"] > 0 and first["dp_collective_bytes"] > 0
    assert first["tokens_per_s"] > 0
    single = read_metrics(runs["tmp"] / "single" / "metrics.jsonl")[0]
    assert single["tp_collective_bytes"] == 0 == single["dp_collective_bytes"]
    assert (runs["tmp"] / "tp2" / "metrics.png").is_file()


def test_reshard_resume(runs: dict[str, Any]) -> None:
    """tp=2's step-3 checkpoint resumed at tp=1 and at dp=2: steps 4.. match the tp=2 run."""
    tmp = runs["tmp"]
    ref = _losses(tmp / "tp2" / "metrics.jsonl")
    assert runs["r_tp1"].start_step == 3
    errs = {}
    for name in ("r_tp1", "r_dp2"):
        got = _losses(tmp / name / "metrics.jsonl")
        assert sorted(got) == list(range(3, STEPS)), name
        errs[name] = _max_rel(got, ref)
    print("max relative loss error of resumed steps 4-10 vs uninterrupted tp=2:", errs)
    assert max(errs.values()) < RTOL, errs


def test_kill_and_resume(runs: dict[str, Any]) -> None:
    """SIGKILL of one rank after a checkpoint; --resume continues; same losses as uninterrupted."""
    tmp = runs["tmp"]
    killed = runs["killed_latest"]
    assert killed is not None
    resumed_from = int(killed.name.removeprefix("step_"))
    assert resumed_from >= 3 and runs["killed_after"] >= resumed_from  # steps were lost
    lines = (tmp / "kill" / "metrics.jsonl").read_text().splitlines()
    starts = [json.loads(line) for line in lines if '"event": "start"' in line]
    assert [s["step"] for s in starts] == [0, resumed_from]
    got = _losses(tmp / "kill" / "metrics.jsonl")
    assert max(got) == STEPS - 1 and sorted(got) == list(range(STEPS))
    err = _max_rel(got, _losses(tmp / "tp2" / "metrics.jsonl"))
    print(
        f"killed after step {runs['killed_after']}, resumed from {killed.name}, max rel {err:.1e}"
    )
    assert err < RTOL
    assert latest(tmp / "kill" / "ckpt").name == f"step_{STEPS}"
    assert not runs["partial"].exists()  # the rerun's save of that step replaced it


def test_clip_norm_matches_single_process(runs: dict[str, Any]) -> None:
    """Step 0's global grad norm at every layout == torch's clip_grad_norm_ on one device."""
    cfg = TrainConfig(**COMMON)
    model = build_model(cfg)
    from boost_compiler.train.data import load_corpus

    ids = load_corpus(None).global_batch(0, cfg.batch, cfg.seq, cfg.seed)
    model(ids, labels=ids).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip).item()
    errs = {
        name: _rel(read_metrics(runs["tmp"] / name / "metrics.jsonl")[0]["grad_norm"], want)
        for name in ("single", "tp2", "dp2", "dp2tp2")
    }
    print(f"torch clip_grad_norm_ {want:.6f}; relative errors {errs}")
    assert want > cfg.clip  # clipping was active
    assert max(errs.values()) < 1e-5, errs


def test_clip_function_equals_torch_in_one_process() -> None:
    """No groups: norm and clipped gradients equal torch.nn.utils.clip_grad_norm_'s."""
    model = build_model(TrainConfig(model_overrides={"n_layers": 1}))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    for m in (model, ref):
        m(ids, labels=ids).backward()
    got = clip_grad_norm_([GradSlot(p, False) for p in model.parameters()], 0.1)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_export_loads_strict_and_reproduces_logits(runs: dict[str, Any], tmp_path: Path) -> None:
    """``boost export``: strict load into the single-device model, same logits."""
    from safetensors.torch import load_file

    from boost_compiler.cli import main

    trained = runs["single"].model
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trained(ids)
    for name in ("single", "tp2", "dp2tp2"):
        out = tmp_path / f"{name}.safetensors"
        assert (
            main(["export", "--checkpoint", str(runs["tmp"] / name / "ckpt"), "--out", str(out)])
            == 0
        )
        fresh = build_model(TrainConfig(seed=123))
        fresh.load_state_dict(load_file(str(out)), strict=True)
        with torch.no_grad():
            got = fresh(ids)
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"export {name}: logits max rel error {err:.1e}")
        if name == "single":
            assert torch.equal(got, want)
        else:
            assert err < RTOL


def test_config_precedence_and_schedule(tmp_path: Path) -> None:
    import argparse

    toml = tmp_path / "run.toml"
    toml.write_text(
        'tp = 2\nsteps = 50\nlr = 0.01\nno-compile = true\n[model]\npreset = "tiny"\nn_layers = 3\n'
    )
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--config", str(toml), "--steps", "7"]))
    assert (cfg.tp, cfg.steps, cfg.lr, cfg.compile) == (2, 7, 0.01, False)
    assert cfg.model_overrides == {"n_layers": 3}
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)


def test_latest_skips_incomplete(tmp_path: Path) -> None:
    for name, files in (("step_3", [".metadata", "train_state.json", "manifest.json"]),
                        ("step_6.tmp", [".metadata", "train_state.json"]),
                        ("step_9", [".metadata"])):  # fmt: skip
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")
    assert latest(tmp_path) == tmp_path / "step_3"


@pytest.mark.skipif(
    os.environ.get("BOOST_FULL_TESTS") != "1",
    reason="compiles on 4 ranks (minutes on 2 cores); BOOST_FULL_TESTS=1 runs it",
)
def test_compiled_dp2_tp2_smoke(runs: dict[str, Any]) -> None:
    """backend="boost" (Inductor) at dp=2 x tp=2, FSDP2: the first 3 losses match eager."""
    tmp = runs["tmp"] / "compiled"
    run = Launch.start(4, tmp, compile=True, dp=2, tp=2, stop_at=3, save_every=0,
                       metrics=tmp / "metrics.jsonl")  # fmt: skip
    run.wait()
    got = _losses(tmp / "metrics.jsonl")
    assert sorted(got) == [0, 1, 2]
    err = _max_rel(got, _losses(runs["tmp"] / "single" / "metrics.jsonl"))
    print(f"compiled dp=2 x tp=2 vs eager one process: max rel {err:.1e}")
    assert err < RTOL
