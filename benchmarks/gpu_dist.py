"""The prepared GPU run's parts that need a process group: mixed precision and symm_mem.

- ``mixed``: ``boost train --mixed-precision bf16`` as a user runs it (one process, FSDP2's
  ``MixedPrecisionPolicy`` on the one-rank dp mesh: fp32 master weights and AdamW moments,
  bf16 compute, fp32 gradient reduction), compiled, on the GPU; tokens/s, MFU and losses
  from the trainer's own metrics file.
- ``symm``: option ``symm_mem_all_reduce`` at tp=2 under torchrun on two GPUs: two layers
  of the preset parallelized, one bf16 training step compiled with the option off (NCCL
  all-reduces) and on; step times, the loss of each, and how many
  ``symm_mem::one_shot_all_reduce`` calls the profiler saw run (what ran, on every rank, not
  the plan). A one-GPU machine skips it with the reason: NCCL refuses two ranks on one GPU.

Run as a script, this module is the ``symm`` part's torchrun worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep + path if path else ''}"}


def _run(cmd: list[str], deadline: float) -> subprocess.CompletedProcess[str]:
    timeout = deadline - time.perf_counter()
    if timeout < 30:
        raise TimeoutError("skipped: time budget")
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=ROOT)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    return proc


def mixed(args: Any, deadline: float) -> dict[str, Any]:
    """``boost train --mixed-precision bf16`` on one device: the trainer's metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "boost_compiler.cli", "train", "--model", args.config,
               "--mixed-precision", "bf16", "--steps", str(args.warmup + args.steps),
               "--warmup", "0", "--batch", str(args.batch), "--seq", str(args.seq),
               "--metrics", str(metrics), "--log-every", "1", "--no-progress"]  # fmt: skip
        if args.peak_tflops:
            cmd += ["--peak-tflops", str(args.peak_tflops)]
        t0 = time.perf_counter()
        _run(cmd, deadline)
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "tokens_per_s" in r][args.warmup :]
    if not steps:
        raise RuntimeError(f"no step past the warm-up in the metrics: {rows[-3:]}")
    med = sorted(steps, key=lambda r: r["step_s"])[len(steps) // 2]
    return {"wall_s": time.perf_counter() - t0, "steps": len(steps), "step_s": med["step_s"],
            "tokens_per_s": med["tokens_per_s"], "mfu": med.get("mfu"),
            "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"]}  # fmt: skip


def symm(args: Any, deadline: float, dry_run: bool) -> dict[str, Any]:
    """``symm_mem_all_reduce`` off and on at tp=2 (torchrun, 2 ranks), or why not."""
    import torch

    gpus = torch.cuda.device_count()
    if not dry_run and gpus < 2:
        return {"skipped": f"needs 2 GPUs on one NCCL group (NCCL refuses two ranks on one "
                           f"GPU); this machine has {gpus}"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "symm.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, str(out), args.config, str(args.batch),
               str(args.seq), str(args.steps), str(args.symm_bytes), "cpu" if dry_run else "cuda"]  # fmt: skip
        _run(cmd, deadline)
        return json.loads(out.read_text())


def _worker(
    out: str, config: str, batch: int, seq: int, steps: int, nbytes: int, kind: str
) -> None:
    """One rank of the ``symm`` part: the option off, then on (the dry run: off only, gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import boost_compiler
    from boost_compiler.device import process_group_backend
    from boost_compiler.models.cola_llama import build, example_inputs

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device))
    mesh = init_device_mesh(device.type, (world,))
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    record: dict[str, Any] = {"tp": world, "bytes": nbytes}
    for name, option in (("nccl", 0), ("symm_mem", nbytes))[: 2 if kind == "cuda" else 1]:
        torch._dynamo.reset()
        model = build(config, device=device, seed=0, n_layers=2).to(dtype)
        (x,) = example_inputs(model.cfg, batch, seq, device=device, seed=0)
        boost_compiler.parallelize(model, mesh, (x,), {"labels": x})
        opts = {"symm_mem_all_reduce": option} if option else None
        run = torch.compile(model, backend="boost", options=opts)
        losses, times = [], []
        for _ in range(steps + 1):  # the first compiles
            t0 = time.perf_counter()
            loss = run(x, labels=x)
            loss.backward()
            if kind == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        with torch.profiler.profile() as prof:
            run(x, labels=x).backward()
        one_shot = sum(e.count for e in prof.key_averages() if "one_shot_all_reduce" in e.key)
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, {"one_shot_calls": one_shot, "losses": losses})
        record[name] = {"compile_s": times[0], "step_s": sorted(times[1:])[len(times[1:]) // 2],
                        "ranks": ranks}  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    _worker(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), a[6])
