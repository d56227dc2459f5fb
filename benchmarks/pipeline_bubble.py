"""Pipeline bubble per schedule, measured: each stage's idle share of the step, vs its theory.

Runs ``pp`` CPU processes (gloo, dp = 1, tp = ``--tp``) of a small CoLA-LLaMA split
by :func:`boost_compiler.train.pipeline.build_pipeline`, one warm-up step, then
``--steps`` timed steps per micro-batch count ``m``. The pipeline's step time ``T`` is
from one barrier to the next (it ends when its slowest rank does); a rank is busy for
the time of its schedule's step less the time it spent in the schedule's P2P waits
(:class:`P2PMeter`), and idle for the rest of ``T``: its bubble is ``idle / T``. The
mean over ranks and steps is printed beside the schedule's ideal (equal stage times, free
communication), every stage's idle share in that model: 1F1B and GPipe
``(pp-1)/(m+pp-1)``; interleaved 1F1B with ``v`` stages per rank ``(pp-1)/(v m+pp-1)`` (its
warm-up and drain are ``v`` times shorter); zero bubble (ZB1P, interleaved) fills the
drain with the weight gradients, ``(pp-1)/(3 v m+pp-1)`` when a stage's forward,
input-gradient and weight-gradient times are equal (its paper's ``T_F = T_B = T_W``).
Also printed, per rank, the first measure of this benchmark, P2P wait over the rank's
own step: it misses the last stage's drain, which that stage waits out inside the
loss broadcast that ends ``Pipeline.step``. What theory leaves out lands in the
measured bubble: the transfers and the schedule's per-micro-batch overhead (a larger
share as micro-batches shrink), and the imbalance of the stages (the first runs the
embedding, the last the LM head and the loss). On shared CPU cores the stages also
compete for the cores: expect noise.

    .venv/bin/python benchmarks/pipeline_bubble.py --pp 2 --microbatches 2 4 8 \
        --schedules 1f1b interleaved-1f1b zero-bubble
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _TimedSchedule:
    """The schedule, timed: ``Pipeline.step`` also broadcasts the loss from the last stage,
    and that broadcast is where the last stage waits out the drain (the first stage's last
    backward), so only the schedule's own time less its P2P waits counts as busy."""

    def __init__(self, schedule: Any) -> None:
        self.schedule, self.seconds = schedule, 0.0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.schedule.step(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from boost_compiler.train.pipeline import init_pipeline_mesh

    mesh = init_pipeline_mesh(args.pp, 1, args.tp)
    rows = []
    for schedule in args.schedules:
        for m in args.microbatches:
            rows += _measure(rank, mesh, args, schedule, m)
    Path(f"{out}.{rank}").write_text(json.dumps(rows))
    dist.destroy_process_group()


class _ChunkTimer:
    """Seconds this rank's stages spend computing micro-batches (their forward and backward
    chunk calls, zero bubble's weight half included): the work theory counts, apart from
    P2P waits and the schedule's own bookkeeping."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: Any) -> None:
        self.seconds = 0.0
        for stage in stages:
            for name in self.METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return run


def _measure(rank: int, mesh: Any, args: argparse.Namespace, schedule: str,
             m: int) -> list[dict[str, Any]]:  # fmt: skip
    """``args.steps`` timed steps of one schedule at ``m`` micro-batches, after a warm-up."""
    from boost_compiler.models import cola_llama as cola
    from boost_compiler.train.pipeline import P2PMeter, build_pipeline

    torch._dynamo.reset()
    model = cola.build("tiny", seed=0, n_layers=args.layers, d_model=args.d_model,
                       rank=args.d_model // 4, d_ff=args.d_model * 3)  # fmt: skip
    pipe = build_pipeline(model, mesh, args.batch, args.seq, m, schedule=schedule,
                          compile=args.compile)  # fmt: skip
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator())
    pipe.step(ids)  # warm-up: the first call compiles each stage's graph
    sched = _TimedSchedule(pipe.schedule)
    pipe.schedule = sched
    chunks = _ChunkTimer(pipe.stages)
    rows = []
    for _ in range(args.steps):
        meter = P2PMeter()
        sched.seconds = chunks.seconds = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        with meter.watch():
            pipe.step(ids)
        dt = time.perf_counter() - t0
        dist.barrier()  # the pipeline's step ends when its slowest rank's does
        total = time.perf_counter() - t0
        rows.append({"schedule": schedule, "m": m, "rank": rank, "step_s": dt,
                     "wait_s": meter.wait_s, "schedule_s": sched.seconds,
                     "compute_s": chunks.seconds, "pipeline_s": total})  # fmt: skip
    return rows


def ideal_bubble(schedule: str, pp: int, m: int, v: int = 2) -> float:
    """The schedule's idle share of a step with equal stage times and free communication."""
    if schedule in ("1f1b", "gpipe"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (3 * v * m + pp - 1)  # zero bubble, T_F = T_B = T_W


def unequal_bubble(compute: list[float], m: int) -> list[float]:
    """1F1B's idle share per rank with the measured stage times and free communication: the
    slowest stage sets the pace, ``T = (m + p - 1) c_max / m`` for per-step computes ``c``."""
    pp = len(compute)
    step = (m + pp - 1) * max(compute) / m
    return [1.0 - c / step for c in compute]


def _idle(r: dict[str, Any]) -> float:
    """The rank's idle share of the pipeline's step: not busy (its schedule less P2P waits)."""
    return 1.0 - (r["schedule_s"] - r["wait_s"]) / r["pipeline_s"]


def _other(r: dict[str, Any]) -> float:
    """The schedule's time that is neither computing nor waiting: its own bookkeeping."""
    return r["schedule_s"] - r["compute_s"] - r["wait_s"]


def _own_wait(r: dict[str, Any]) -> float:
    return r["wait_s"] / r["step_s"]


def _mean(rows: list[dict[str, Any]], fn: Callable[[dict[str, Any]], float],
          rank: int | None = None) -> float:  # fmt: skip
    vals = [fn(r) for r in rows if rank is None or r["rank"] == rank]
    return sum(vals) / len(vals)


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def main(argv: list[str] | None = None) -> dict[int, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["1f1b"],
                   choices=["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"])  # fmt: skip
    p.add_argument("--compile", action="store_true", help="compiled stages (not zero-bubble)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    world = args.pp * args.tp
    tmp = tempfile.mkdtemp(prefix="boost-bubble-")
    out = os.path.join(tmp, "rows")
    mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), args, out), nprocs=world)
    rows = [r for k in range(world) for r in json.loads(Path(f"{out}.{k}").read_text())]
    summary: dict[str, dict[int, dict[str, Any]]] = {}
    for schedule in args.schedules:
        for m in args.microbatches:
            mine = [r for r in rows if r["m"] == m and r["schedule"] == schedule]
            ideal = ideal_bubble(schedule, args.pp, m)
            step = sorted(r["pipeline_s"] for r in mine)[len(mine) // 2]
            row = {"bubble": _mean(mine, _idle), "ideal": ideal, "step_s": step,
                   "per_rank": [_mean(mine, _idle, k) for k in range(world)],
                   "own_wait": [_mean(mine, _own_wait, k) for k in range(world)],
                   "compute_s": [_mean(mine, lambda r: r["compute_s"], k) for k in range(world)],
                   "other_s": [_mean(mine, _other, k) for k in range(world)]}  # fmt: skip
            if schedule in ("1f1b", "gpipe") and args.tp == 1:
                row["unequal"] = sum(unequal_bubble(row["compute_s"], m)) / world
            summary.setdefault(schedule, {})[m] = row
            print(f"{schedule:>16} pp={args.pp} tp={args.tp} m={m}: bubble {row['bubble']:.3f} "
                  f"(ideal {ideal:.3f}; per rank {_fmt(row['per_rank'])}; P2P wait / own step, "
                  f"no drain {_fmt(row['own_wait'])}), median step {step:.3f} s; compute per rank "
                  f"{_fmt(row['compute_s'])} s, bookkeeping {_fmt(row['other_s'])} s"
                  + (f"; 1F1B at these stage times {row['unequal']:.3f}" if "unequal" in row
                     else ""))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
