"""How long a rank waits for one gloo all-reduce, blocking vs polling (issue 28's why).

    python benchmarks/collective_latency.py            # 2 processes x 1 thread, idle machine

Per size: the median over ``--reps`` all-reduces between ``--tp`` processes, each rank
waiting the way ``wait_tensor`` does (``block``: a condition variable) or the way
``boost::collective_wait`` does (``poll``: ``sched_yield`` until the Work completes;
``boost_compiler/lowering/poll_waits.py``); then a layer's pattern, a GEMM followed by an
all-reduce of its [b, s, r] output (d=512 -> r=128 over 1024 tokens). On a machine whose
idle cores sleep (a VM's vCPUs), a blocked waiter's wake-up costs more than the transfer.
``CPU / wall (block)``: the CPU time all of a rank's threads spend in blocked all-reduces
(the waiter sleeps: it is gloo's own work), over their wall time: near 1, a core is busy
for the whole transfer, and that core is taken from compute, overlapped or not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from boost_compiler.bench.harness import spawn
from boost_compiler.lowering.poll_waits import _complete

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the spawned workers import this script as a module
    sys.path.insert(0, str(ROOT))
SIZES = (1024, 32768, 131072, 393216, 1048576)  # floats: 4 KiB .. 4 MiB


def _all_reduce(x: torch.Tensor, poll: bool) -> None:
    import torch.distributed as dist

    _complete(dist.all_reduce(x, async_op=True), poll)


def measure(*, rank: int, world: int, mesh: Any, reps: int) -> dict[str, Any]:
    """Spawned: per wait mode, the median latency per size and of GEMM + all-reduce (ms)."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    a, b = torch.randn(1024, 512), torch.randn(512, 128)
    for mode in ("block", "poll"):
        poll = mode == "poll"
        for n in SIZES:
            x = torch.randn(n)
            for _ in range(3):
                _all_reduce(x, poll)
            dist.barrier()
            ts = []
            cpu0 = time.process_time()
            for _ in range(reps):
                t0 = time.perf_counter()
                _all_reduce(x, poll)
                ts.append(time.perf_counter() - t0)
            out[f"{mode} {n * 4}"] = statistics.median(ts) * 1e3
            # CPU time of every thread of this process (gloo's included), per all-reduce
            # as a share of the wall time (mean, where the columns are medians)
            out[f"{mode} cpu {n * 4}"] = (time.process_time() - cpu0) / sum(ts)
        y = torch.empty(1024, 128)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=y)
            _all_reduce(y, poll)
        out[f"{mode} gemm+all-reduce"] = (time.perf_counter() - t0) / reps * 1e3
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b, out=y)
    out["gemm alone"] = (time.perf_counter() - t0) / reps * 1e3
    return {"ms": out}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    res = spawn("benchmarks.collective_latency:measure", args.tp, {"reps": args.reps},
                timeout_s=600, threads=1, tag="latency")  # fmt: skip
    if "error" in res:
        print(res.get("traceback", res["error"]))
        return 1
    ranks = [r["ms"] for r in res["per_rank"]]
    t = Table(title=f"gloo all-reduce, {args.tp} processes x 1 thread: median ms per call "
              "(slowest rank)", title_justify="left")  # fmt: skip
    for c in ("payload", "block", "CPU / wall (block)", "poll", "poll / block"):
        t.add_column(c, justify="right")
    rows = [(f"{n * 4 / 1024:.0f} KiB", f"{n * 4}") for n in SIZES]
    rows.append(("GEMM [1024,512]x[512,128] + all-reduce", "gemm+all-reduce"))
    for label, key in rows:
        blk = max(r[f"block {key}"] for r in ranks)
        pol = max(r[f"poll {key}"] for r in ranks)
        cpu = max(r.get(f"block cpu {key}", float("nan")) for r in ranks)
        t.add_row(label, f"{blk:.2f}", f"{cpu:.2f}", f"{pol:.2f}", f"{pol / blk:.2f}")
    t.caption = (
        f"the GEMM alone: {max(r['gemm alone'] for r in ranks):.2f} ms; CPU / wall: all of a "
        "rank's threads' CPU time over the summed wall time of its blocked calls (the larger "
        "rank's; not measured for the GEMM row)"
    )
    Console().print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
