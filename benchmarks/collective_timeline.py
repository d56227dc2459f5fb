"""Where a rank's collective wait goes in training: waiting for the peer, or the transfer.

    python benchmarks/collective_timeline.py            # size large, tp=2, 1 thread per rank

Issue 28's open question. The breakdown reports exposed communication (time a rank spends
in a collective's wait) of about 120 ms per step at V=256, where the polled microbenchmark
(``collective_latency.py``) puts each of the 38 collectives at well under a millisecond.
Two things can fill a wait: *skew* (the peer has not yet issued the collective: its compute
since the last collective took longer) and *transfer* (both have issued; gloo's threads
move the data). This script times every collective of a few compiled BOOST training steps
on every rank with one clock (``CLOCK_MONOTONIC`` is shared by the processes of a machine):
when each rank issued it, began waiting and saw it complete. Per rank, the wait splits into
time before the last rank issued (skew) and after (transfer and wake-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the spawned workers import this script as a module
    sys.path.insert(0, str(ROOT))


def _instrument(log: list[list[float]]) -> None:
    """Record ``[issue, wait start, done, issuing s]`` of every collective the compiled graphs start
    through ``boost::*_start`` (``lowering/poll_waits.py``), in issue order."""
    import torch.distributed as dist

    from boost_compiler.lowering import poll_waits

    by_work: dict[int, list[float]] = {}

    def timed(fn: Any, payload: int) -> Any:  # payload: the argument sent (all-gather: 1)
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            work = fn(*args, **kwargs)
            row = [t, float("nan"), float("nan"), time.perf_counter() - t, args[payload].nbytes]
            log.append(row)
            by_work[id(work)] = row
            return work

        return call

    complete = poll_waits._complete

    def timed_complete(work: Any, poll: bool) -> None:
        row = by_work.pop(id(work), None)
        t = time.perf_counter()
        complete(work, poll)
        if row is not None:
            row[1], row[2] = t, time.perf_counter()

    dist.all_reduce = timed(dist.all_reduce, 0)
    dist.all_gather_single = timed(dist.all_gather_single, 1)  # poll_waits.all_gather_start
    poll_waits._complete = timed_complete


def measure(*, rank: int, world: int, mesh: Any, size: str, steps: int,
            options: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Spawned: this rank's per-step collective timeline and step times."""
    import torch.distributed as dist

    from boost_compiler.bench.analysis import SIZES
    from boost_compiler.bench.harness import make_model, parallelize
    from boost_compiler.bench.training import make_optimizer

    spec = SIZES[size]
    torch.manual_seed(0)
    model = make_model("boost", spec)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq))
    parallelize("boost", model, mesh, ids, world)
    run = torch.compile(model, backend="boost", options=options)
    opt = make_optimizer(model, 1e-3)

    def step() -> None:
        loss = run(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    log: list[list[float]] = []
    _instrument(log)
    out: dict[str, Any] = {"steps": []}
    for _ in range(steps):
        dist.barrier()
        del log[:]
        t0 = time.perf_counter()
        step()
        out["steps"].append(
            {"start": t0, "end": time.perf_counter(), "log": [list(r) for r in log]}
        )
    return out


def _analyse(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank, the median over steps of: step ms, collectives, wait ms, of it skew ms."""
    world = len(ranks)
    per_rank: list[dict[str, list[float]]] = [
        {"step": [], "issue": [], "wait": [], "skew": [], "transfer": [], "n": []}
        for _ in range(world)
    ]
    worst: list[tuple[float, int, int]] = []  # (skew ms, step, collective)
    for s in range(len(ranks[0]["steps"])):
        logs = [r["steps"][s]["log"] for r in ranks]
        n = min(len(lg) for lg in logs)
        for r in range(world):
            st = ranks[r]["steps"][s]
            acc = per_rank[r]
            acc["step"].append((st["end"] - st["start"]) * 1e3)
            acc["n"].append(n)
            wait = skew = issuing = 0.0
            for i in range(n):
                issue, w0, done, issuing_s, _ = logs[r][i]
                issuing += issuing_s
                last = max(lg[i][0] for lg in logs)
                wait += done - w0
                skew += max(0.0, min(last, done) - w0)
                if r == 0:
                    issues = [lg[i][0] for lg in logs]
                    worst.append(((max(issues) - min(issues)) * 1e3, s, i))
            acc["issue"].append(issuing * 1e3)
            acc["wait"].append(wait * 1e3)
            acc["skew"].append(skew * 1e3)
            acc["transfer"].append((wait - skew) * 1e3)
    med = [{k: statistics.median(v) for k, v in acc.items()} for acc in per_rank]
    per_coll = []  # each collective's median wait per rank (ms), over the steps
    for i in range(min(len(st["log"]) for r in ranks for st in r["steps"])):
        rows = [[st["log"][i] for st in r["steps"]] for r in ranks]
        waits = [statistics.median((x[2] - x[1]) * 1e3 for x in rr) for rr in rows]
        per_coll.append((i, rows[0][0][4], waits))
    return {"ranks": med, "worst": sorted(worst, reverse=True)[:8], "per_coll": per_coll}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from boost_compiler.bench.harness import spawn
    from boost_compiler.bench.suite import process_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="large")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    # "block" leaves torch's collectives unsplit, which this script cannot see
    ap.add_argument("--wait", default="auto", choices=("auto", "poll"))
    ap.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                    help="option overlap_comm (auto: the default, on for gloo)")  # fmt: skip
    ap.add_argument("--verbose", action="store_true", help="each collective's median wait")
    ap.add_argument("--bind-cores", action="store_true", help="each rank on its own core")
    ap.add_argument("--thp", action=argparse.BooleanOptionalAction, default=True,
                    help="THP_MEM_ALLOC_ENABLE=1, as boost bench (--no-thp: 4 KiB pages)")  # fmt: skip
    ap.add_argument("--heap-reuse", action=argparse.BooleanOptionalAction, default=True,
                    help="glibc keeps its heap, as boost bench (bench/suite.py HEAP_REUSE)")  # fmt: skip
    args = ap.parse_args(argv)
    overlap = {"auto": "auto", "on": True, "off": False}[args.overlap]
    options = {"collective_wait": args.wait, "overlap_comm": overlap}
    res = spawn("benchmarks.collective_timeline:measure", args.tp,
                {"size": args.size, "steps": args.steps, "options": options},
                timeout_s=1200, threads=1, tag="timeline", bind=args.bind_cores,
                env=process_env(args))  # fmt: skip
    if "error" in res:
        print(res.get("traceback", res["error"]))
        return 1
    if not any(st["log"] for r in res["per_rank"] for st in r["steps"]):
        print("no collective went through boost's start/wait ops: nothing to time")
        return 1
    a = _analyse(res["per_rank"])
    bound = (", ranks bound to cores" if args.bind_cores else "") + ("" if args.thp else ", no THP")
    bound += "" if args.heap_reuse else ", no heap reuse"
    t = Table(title=f"BOOST, size {args.size}, tp={args.tp}, {options}{bound}: median per step (ms)",
              title_justify="left")  # fmt: skip
    for c in ("rank", "step", "collectives", "issuing", "in waits", "of it: peer late (skew)",
              "of it: both issued (transfer)"):  # fmt: skip
        t.add_column(c, justify="right")
    for r, m in enumerate(a["ranks"]):
        t.add_row(str(r), f"{m['step']:.0f}", f"{m['n']:.0f}", f"{m['issue']:.1f}", f"{m['wait']:.1f}",
                  f"{m['skew']:.1f}", f"{m['transfer']:.1f}")  # fmt: skip
    t.caption = (
        "collectives split into boost's start/wait ops only; largest issue skews (ms, step, collective): "
        + ", ".join(f"{ms:.1f} ({s}, {i})" for ms, s, i in a["worst"][:5])
    )
    Console().print(t)
    if args.verbose:
        for i, nbytes, ms in a["per_coll"]:
            print(i, nbytes // 1024, "KiB", " ".join(f"{x:.2f}" for x in ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
