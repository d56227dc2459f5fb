"""``boost bench``: BOOST vs torch's own tensor parallelism, measured and predicted, in one run.

    boost bench                                  # defaults (sizes small, large, large-v32k)
    python -m boost_compiler.bench --sizes small --steps 10 --gemm-scales small
    boost bench --sizes tiny --steps 2 --warmup 1 --gemm-scales tiny   # a smoke run

Writes ``bench-results/<timestamp>/``: ``results.json`` (everything, raw per-step times and
per-event collective shapes included), ``tables.txt`` (the console tables), ``*.png`` charts
(matplotlib, optional) and ``logs/`` (each process's output).

Systems (``--systems``); the tensor-parallel ones share one set of ``--tp`` spawned processes,
the single-process ones another (``harness.spawn``), and within a group the systems are
timed in interleaved rounds (``training.py``), so a drifting background load hits all alike:

``boost``            ``boost_compiler.parallelize`` + ``torch.compile(model, backend="boost")``
                     (the backend's defaults: every pass), ``--tp`` processes.
``dtensor-lowrank``  the same low-rank model, torch DTensor TP as torchtitan runs LLaMA
                     (``bench/peers.py``): the standard plan (Megatron per factor pair) in the
                     blocks, sequence parallelism, vocabulary-parallel embedding and head,
                     ``loss_parallel``; each block ``torch.compile``'d (Inductor), ``--tp``
                     processes.
``dtensor-dense``    the dense model of the same d/d_ff, torchtitan's LLaMA plan itself, the
                     same compile, ``--tp`` processes.
``inductor``         the low-rank model on one process, ``torch.compile(model)``.
``eager``            the low-rank model on one process, eager.
``boost-block``, ``boost-no-overlap``, ``boost-whole`` (not in the defaults): BOOST with
                     torch's blocking collective waits instead of polled ones (which also
                     turns the overlap off), without communication overlapped with compute
                     (options ``collective_wait``, ``overlap_comm``), or compiled as one graph
                     instead of per block (``parallelize(..., options={"compile_blocks":
                     False})``): each lever on and off in the same run.
``dtensor-lowrank-nosp``, ``dtensor-dense-nosp`` (not in the defaults): the previous
                     baselines, Megatron in the blocks only (embedding, norms, head and the
                     full logits and loss replicated), ``torch.compile(model)``.

Sizes (``--sizes``): ``small`` and ``large`` (V=256) and ``large-v32k`` (``large`` with
LLaMA-2's and the paper's V=32,000) by default; ``large-v128k`` (LLaMA-3's V=128,256) on
request. All train with fused AdamW on the same fixed batches from the same seed: the
losses of the low-rank systems must agree step by step (column "loss vs eager"). A step is
forward + backward + optimizer; its time is the slowest rank's; the median over
``--steps`` timed steps (rounds) after ``--warmup`` steps (the first compiles) is
reported, with the 25-75% range, and tokens/s, parallel efficiency ``T(1 process,
Inductor) / (p x T(system))``, the ratios to BOOST, and per rank: parameter, gradient and
AdamW-state bytes (its local tensors) and the step's peak tensor memory (CPU: from
``torch.profiler``'s memory records, ``training.memory_of_step``).
Threads: a tensor-parallel rank gets cores/tp threads (tp=2 on 2 cores: one core each, the
CPU analogue of one GPU per rank); the single-process systems get the same (one "device"),
``--single-threads`` changes that. Why not all cores for them: Inductor's and ATen's
OpenMP regions are fine-grained, and on a shared machine with other jobs running a 2-thread
process stalls at every barrier (measured here: 6.5 ms/step on one thread, 20-1300 ms on
two), which would measure the neighbours, not the system. Memory: every process starts with
``THP_MEM_ALLOC_ENABLE=1`` (``--no-thp`` drops it), PyTorch's CPU tuning switch that backs
tensors of 2 MiB and more with transparent huge pages: without it each step's fresh large
buffers (the ``[N, V/p]`` logits and their gradient, 65 MB at V=32,000) are faulted in 4 KiB
at a time, which on this VM took 50-200 ms more on one rank than on the other in the same
step (``benchmarks/collective_timeline.py``), charged to the peer as waiting. And with
``MALLOC_MMAP_MAX_=0`` and a large ``MALLOC_TRIM_THRESHOLD_`` (``--no-heap-reuse`` drops
them): glibc otherwise maps each block over 32 MiB afresh and unmaps it when freed, so every
step faults in its largest buffers again, however large the pages. One process's loss
backward at V=32,000 (one fresh ``[N, V]`` buffer) took 135-284 ms a step without it and
54-73 ms with it: the baseline of the parallel efficiency, slowed by its allocator, not its
compute. The heap reuses a block only where it has one free of that size: a rank's steps
still fault a buffer in now and then (``benchmarks/step_faults.py``).

Communication: one extra step of each tensor-parallel system under ``torch.profiler``; every
``gloo:*`` event counted (``harness.count_collectives``). Next to each measured figure: the
cost model's prediction (``boost_compiler.costmodel``: ``n_layers`` x the per-layer formula of
the strategy, fp32, plus the step's extra collectives outside the layers for BOOST; for the
torchtitan plans ``peers.predict``, the same kind of formula, the optimizer's norm-gradient
all-reduces included) and, for
BOOST, the plan that ``parallelize`` built from the captured graph (``costmodel.plan_comm``).
Bytes must agree exactly; "match" says whether they do.

GEMM microbench: ``boost_compiler/bench/gemm.py`` (one layer's per-rank forward GEMMs of every
strategy; K = r/p for standard TP vs K = d/p for BTP), on one thread: one TP rank's share.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from .analysis import DEFAULT_SIZES, SIZES, analyse, boost_formula_key, predict, split_group
from .charts import plots
from .harness import spawn
from .tables import (
    breakdown_table,
    comm_table,
    escape,
    kinds_table,
    ratio_lines,
    summary_table,
    time_table,
)
from .training import DEFAULT_SYSTEMS, SYSTEMS, TP_SYSTEMS

__all__ = [
    "SIZES", "analyse", "breakdown_table", "comm_table", "main", "plots", "predict",
    "ratio_lines", "run", "split_group", "summary_table", "time_table",
]  # fmt: skip

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # in a source checkout: its git commit
THP = {"THP_MEM_ALLOC_ENABLE": "1"}  # --thp: torch reads it once, at its first allocation
# --heap-reuse: glibc's malloc (mallopt(3)'s environment names) serves every block from its
# heap and never gives the heap back, so a step's large buffers can reuse the last step's.
# The tuning guide's answer is jemalloc or TCMalloc via LD_PRELOAD: system packages this
# machine's CI cannot install; glibc's own switches need none.
HEAP_REUSE = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
DEFAULT_GEMM_SCALES = ("small", "large", "xl")
BREAKDOWN_STEPS = 5  # profiled steps per system; the one of median wall time is split


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-results", help="results go to OUT/<timestamp>/")
    p.add_argument(
        "--sizes", default=",".join(DEFAULT_SIZES), help=f"comma-separated from {', '.join(SIZES)}"
    )
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated from {', '.join(SYSTEMS)}",
    )
    p.add_argument("--tp", type=int, default=2, help="processes of the tensor-parallel systems")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median over them)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (1st compiles)")
    p.add_argument(
        "--gemm-scales",
        default=",".join(DEFAULT_GEMM_SCALES),
        help="GEMM microbench scales (boost_compiler.bench.gemm.SCALES), or 'none'",
    )
    p.add_argument(
        "--single-threads",
        type=int,
        default=None,
        help="threads of the 1-process systems (default: one TP rank's share, cores/tp)",
    )
    p.add_argument("--gemm-threads", type=int, default=1, help="threads of the GEMM microbench")
    p.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split each rank's step into GEMM, other compute, exposed communication, "
        f"optimizer and overhead, from {BREAKDOWN_STEPS} more profiled steps (bench/breakdown.py)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    p.add_argument(
        "--thp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every system's processes start with THP_MEM_ALLOC_ENABLE=1: torch's CPU "
        "allocator backs tensors of 2 MiB and more with transparent huge pages (PyTorch's "
        "CPU tuning guide), so a step's fresh large buffers are not faulted in 4 KiB at a time",
    )
    p.add_argument(
        "--heap-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every system's processes start with MALLOC_MMAP_MAX_=0 and a 64 GiB "
        "MALLOC_TRIM_THRESHOLD_: glibc serves large tensors from its heap and keeps it, so "
        "a step's large buffers can reuse the previous step's pages instead of fresh ones",
    )
    p.add_argument(
        "--bind-cores",
        action="store_true",
        help="bind each process to its own cores (rank r: the r-th share of cores/tp; a "
        "single process: the first share), as torch.backends.xeon.run_cpu binds instances",
    )
    p.add_argument(
        "--timeout", type=float, default=3600, help="seconds per group (all sizes) before kill"
    )


def _check(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    sizes = [s for s in args.sizes.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    scales = [s for s in args.gemm_scales.split(",") if s and s != "none"]
    for s in sizes:
        if s not in SIZES:
            raise ValueError(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.bind_cores and args.tp > len(os.sched_getaffinity(0)):
        raise ValueError(f"--bind-cores: {args.tp} processes need {args.tp} cores or more")
    if args.steps < 1 or args.warmup < 1:
        raise ValueError("--steps and --warmup must be >= 1 (the first warm-up step compiles)")
    from .gemm import SCALES

    for s in scales:
        if s not in SCALES:
            raise ValueError(f"unknown GEMM scale {s!r}; choose from {', '.join(SCALES)}")
    return sizes, [s for s in SYSTEMS if s in systems], scales


# --------------------------------------------------------------------------- main


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("boost-compiler")
    except PackageNotFoundError:
        return ""


def process_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables every system's processes start with (``--thp``, ``--heap-reuse``)."""
    return {**(THP if args.thp else {}), **(HEAP_REUSE if args.heap_reuse else {})}


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from boost_compiler.passes import PIPELINE

    try:
        commit = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=10, check=False,
        ).stdout.strip()  # fmt: skip
    except OSError:
        commit = ""
    return {
        "time": datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "boost_compiler": _version(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_start": list(os.getloadavg()),
        "git_commit": commit,
        "boost_pipeline": [p.name for p in PIPELINE],
        "boost_formula": boost_formula_key(),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "process_env": process_env(args),
        "sizes": {s: SIZES[s].as_dict() for s in args.sizes.split(",") if s in SIZES},
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status (1 if a system failed or bytes disagree)."""
    from rich.console import Console

    sizes, systems, scales = _check(args)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / stamp
    (out / "logs").mkdir(parents=True, exist_ok=True)
    console = Console(record=True, width=170)
    console.print(
        f"boost bench -> {out}  (sizes {', '.join(sizes)}; systems {', '.join(systems)})",
        markup=False,
    )
    meta = _meta(args)
    t_start = time.perf_counter()
    results = _run_systems(args, console, sizes, systems, out)
    gemm: list[dict[str, Any]] = []
    if scales:
        from . import gemm as gemm_mod

        with console.status("GEMM microbench ..."):
            gemm = gemm_mod.run(scales, tp=args.tp, threads=args.gemm_threads)
    summary = analyse(results, sizes, args.tp)
    _print_tables(console, args, summary, sizes, systems, meta, gemm)
    failures = _print_failures(console, summary)
    meta["load_average_end"] = list(os.getloadavg())
    meta["wall_s"] = time.perf_counter() - t_start
    files = [] if args.no_plots else plots(summary, gemm, out)
    record = {
        "meta": meta,
        "summary": summary,
        "gemm": gemm,
        "raw": {s: {k: v for k, v in r.items() if k != "per_rank"} for s, r in results.items()},
        "failures": failures,
        "charts": files,
    }
    (out / "results.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    console.print(
        f"wrote {out / 'results.json'}" + (f", {', '.join(files)}" if files else "")
        + f" in {meta['wall_s']:.0f} s; load average {meta['load_average_start'][0]:.1f} at start, "
        f"{meta['load_average_end'][0]:.1f} at end (other jobs on this machine skew timings)"
    )  # fmt: skip
    console.save_text(str(out / "tables.txt"))
    return 1 if failures else 0


def _run_systems(
    args: argparse.Namespace, console: Any, sizes: list[str], systems: list[str], out: Path
) -> dict[str, dict[str, Any]]:
    """Spawn the TP systems on ``args.tp`` processes, then the others on one; per-system results."""
    specs = {s: SIZES[s].as_dict() for s in sizes}
    results: dict[str, dict[str, Any]] = {}
    groups = [
        ("tp", args.tp, [s for s in systems if s in TP_SYSTEMS]),
        ("single", 1, [s for s in systems if s not in TP_SYSTEMS]),
    ]
    for tag, world, members in groups:
        if not members:
            continue
        threads = max(1, (os.cpu_count() or 1) // args.tp)
        if world == 1 and args.single_threads:
            threads = args.single_threads
        t0 = time.perf_counter()
        with console.status(f"{', '.join(members)} ({world} process(es)): {', '.join(sizes)} ..."):
            res = spawn(
                "boost_compiler.bench.training:run_group", world,
                {"systems": members, "specs": specs, "steps": args.steps, "warmup": args.warmup,
                 "breakdown_steps": BREAKDOWN_STEPS if args.breakdown else 0},
                timeout_s=args.timeout, threads=threads, tag=tag, log_dir=out / "logs",
                bind=args.bind_cores, env=process_env(args),
            )  # fmt: skip
        results.update(split_group(res, members))
        for system in members:
            done = []
            for size in sizes:
                r = results[system]["sizes"].get(size, {})
                if "step_times" in r:
                    med = statistics.median(x[3] for x in r["step_times"])
                    done.append(
                        f"{size} {med * 1e3:.1f} ms/step (first step {r['first_step_s']:.0f} s)"
                    )
                else:
                    done.append(f"{size} [red]failed[/]: {escape(str(r.get('error', '?')))}")
            console.print(f"[bold]{system}[/]: " + "; ".join(done))
        console.print(f"({', '.join(members)}: {time.perf_counter() - t0:.0f} s)")
    return results


def _print_tables(
    console: Any,
    args: argparse.Namespace,
    summary: dict[str, dict[str, Any]],
    sizes: list[str],
    systems: list[str],
    meta: dict[str, Any],
    gemm: list[dict[str, Any]],
) -> None:
    if any(s in TP_SYSTEMS for s in systems):
        console.print(comm_table(summary, args.tp))
        terms = "; ".join(
            f"{s}: {predict(s, SIZES[sizes[0]], args.tp)['terms']}"
            for s in systems
            if s in TP_SYSTEMS
        )
        console.print(
            f"cost model: {terms} (BOOST formula: '{meta['boost_formula']}', "
            f"passes {meta['boost_pipeline']})",
            markup=False,
        )
    console.print(summary_table(summary, args.tp))
    console.print(time_table(summary, args.tp))
    console.print(breakdown_table(summary))
    console.print(kinds_table(summary))
    for line in ratio_lines(summary):
        console.print(line)
    if gemm:
        from .gemm import table as gemm_table

        console.print(gemm_table(gemm))


def _print_failures(console: Any, summary: dict[str, dict[str, Any]]) -> list[str]:
    """Print what failed or disagreed (and the warnings); the failures, one line each."""
    failures = []
    for size, rows in summary.items():
        for system, r in rows.items():
            if "error" in r:
                failures.append(f"{system} at {size}: {r['error']}")
                tail = "\n".join(str(r.get("traceback", "")).strip().splitlines()[-15:])
                console.print(f"[red]{system} at {size} failed[/]: {escape(r['error'])}")
                if tail:
                    console.print(tail, markup=False, highlight=False)
            elif system in TP_SYSTEMS and not (r.get("bytes_match") and r.get("plan_match", True)):
                failures.append(f"{system} at {size}: measured bytes differ from the prediction")
                console.print(f"[red]{system} at {size}: measured vs predicted collectives:[/]")
                for k, v in r.get("comm", {}).get("shapes", {}).items():
                    console.print(f"   {v:4d} x {k}", markup=False, highlight=False)
            if r.get("fallbacks"):
                console.print(f"[yellow]{system} at {size}: fallbacks {r['fallbacks']}[/]")
            if system in TP_SYSTEMS and r.get("ranks_agree") is False:
                console.print(f"[yellow]{system} at {size}: ranks ran different collectives[/]")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="boost bench",
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        ap.error(str(err))
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
