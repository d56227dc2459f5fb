"""Pipeline bubble of 1F1B, measured: time waiting on P2P over step time, vs (pp-1)/(m+pp-1).

Runs ``pp`` CPU processes (gloo, dp = 1, tp = ``--tp``) of a small CoLA-LLaMA split
by :func:`boost_compiler.train.pipeline.build_pipeline`, one warm-up step, then
``--steps`` timed steps per micro-batch count. Per rank: the wall time of a step and
the time spent in the schedule's P2P waits (:class:`P2PMeter`); the bubble fraction is
their ratio, the mean over ranks and steps is printed beside the ideal
``(pp-1)/(m+pp-1)`` (equal stage times, free communication). On shared CPU cores the
stages also compete for the cores, so expect the measured fraction to be noisy.

    .venv/bin/python benchmarks/pipeline_bubble.py --pp 2 --microbatches 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from boost_compiler.models import cola_llama as cola
    from boost_compiler.train.pipeline import P2PMeter, build_pipeline, init_pipeline_mesh

    mesh = init_pipeline_mesh(args.pp, 1, args.tp)
    rows = []
    for m in args.microbatches:
        torch._dynamo.reset()
        model = cola.build("tiny", seed=0, n_layers=args.layers, d_model=args.d_model,
                           rank=args.d_model // 4, d_ff=args.d_model * 3)  # fmt: skip
        pipe = build_pipeline(model, mesh, args.batch, args.seq, m, schedule="1f1b")
        ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator())
        pipe.step(ids)  # warm-up: the first call compiles each stage's graph
        for _ in range(args.steps):
            meter = P2PMeter()
            dist.barrier()
            t0 = time.perf_counter()
            with meter.watch():
                pipe.step(ids)
            dt = time.perf_counter() - t0
            rows.append({"m": m, "rank": rank, "step_s": dt, "wait_s": meter.wait_s})
    Path(f"{out}.{rank}").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    world = args.pp * args.tp
    tmp = tempfile.mkdtemp(prefix="boost-bubble-")
    out = os.path.join(tmp, "rows")
    mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), args, out), nprocs=world)
    rows = [r for k in range(world) for r in json.loads(Path(f"{out}.{k}").read_text())]
    summary = {}
    for m in args.microbatches:
        mine = [r for r in rows if r["m"] == m]
        frac = sum(r["wait_s"] / r["step_s"] for r in mine) / len(mine)
        step = sorted(r["step_s"] for r in mine)[len(mine) // 2]
        ideal = (args.pp - 1) / (m + args.pp - 1)
        summary[m] = {"bubble": frac, "ideal": ideal, "step_s": step}
        print(f"pp={args.pp} tp={args.tp} m={m}: measured bubble {frac:.3f} "
              f"(P2P wait / step, mean over ranks), ideal {ideal:.3f}, median step {step:.3f} s")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
