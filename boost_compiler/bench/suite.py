"""``boost bench``: BOOST vs torch's own tensor parallelism, measured and predicted, in one run.

    boost bench                                  # defaults: < 10 min on a 2-core CPU machine
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
``dtensor-lowrank``  the same low-rank model, torch DTensor TP, the standard (Megatron per
                     factor pair) plan, ``torch.compile(model)`` (Inductor), ``--tp`` processes.
``dtensor-dense``    the dense model of the same d/d_ff, torch DTensor TP (Megatron plan of
                     torch's TP tutorial), ``torch.compile(model)``, ``--tp`` processes.
``inductor``         the low-rank model on one process, ``torch.compile(model)``.
``eager``            the low-rank model on one process, eager.

All train with fused AdamW on the same fixed batches from the same seed: the losses of the four
low-rank systems must agree step by step (column "loss vs eager"). A step is forward +
backward + optimizer; its time is the slowest rank's; the median over ``--steps`` timed
steps (rounds) after ``--warmup`` steps (the first compiles) is reported, with the 25-75%
range.
Threads: a tensor-parallel rank gets cores/tp threads (tp=2 on 2 cores: one core each, the
CPU analogue of one GPU per rank); the single-process systems get the same (one "device"),
``--single-threads`` changes that. Why not all cores for them: Inductor's and ATen's
OpenMP regions are fine-grained, and on a shared machine with other jobs running a 2-thread
process stalls at every barrier (measured here: 6.5 ms/step on one thread, 20-1300 ms on
two), which would measure the neighbours, not the system.

Communication: one extra step of each tensor-parallel system under ``torch.profiler``; every
``gloo:*`` event counted (``harness.count_collectives``). Next to each measured figure: the
cost model's prediction (``boost_compiler.costmodel``: ``n_layers`` x the per-layer formula of
the strategy, fp32, plus the step's extra collectives outside the layers for BOOST) and, for
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

from .harness import ModelSpec, spawn
from .training import SYSTEMS, TP_SYSTEMS


def escape(text: str) -> str:
    """``text`` shown literally in rich markup (errors quote ``[file:line]``)."""
    from rich.markup import escape as _escape

    return _escape(text)


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # in a source checkout: its git commit

SIZES: dict[str, ModelSpec] = {
    # a smoke-test size (the "tiny" preset of boost_compiler.models.cola_llama)
    "tiny": ModelSpec(d=64, ff=172, rank=16, layers=2, heads=4, batch=2, seq=32),
    # the reference decoder of the README's measurements
    "small": ModelSpec(d=256, ff=688, rank=64, layers=2, heads=4, batch=2, seq=64),
    # the CoLA "60m" width at 4 layers
    "large": ModelSpec(d=512, ff=1376, rank=128, layers=4, heads=8, batch=4, seq=256),
}
DEFAULT_SIZES = ("small", "large")
DEFAULT_GEMM_SCALES = ("small", "large", "xl")
LABELS = {
    "boost": "BOOST (boost_compiler, tp)",
    "dtensor-lowrank": "DTensor TP, standard low-rank plan",
    "dtensor-dense": "DTensor TP, dense model",
    "inductor": "1 process, backend='inductor'",
    "eager": "1 process, eager",
}
COST_KEY = {"dtensor-lowrank": "standard", "dtensor-dense": "dense"}


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-results", help="results go to OUT/<timestamp>/")
    p.add_argument(
        "--sizes", default=",".join(DEFAULT_SIZES), help=f"comma-separated from {', '.join(SIZES)}"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
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
    p.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds per system (all sizes) before kill"
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
    if args.steps < 1 or args.warmup < 1:
        raise ValueError("--steps and --warmup must be >= 1 (the first warm-up step compiles)")
    from .gemm import SCALES

    for s in scales:
        if s not in SCALES:
            raise ValueError(f"unknown GEMM scale {s!r}; choose from {', '.join(SCALES)}")
    return sizes, [s for s in SYSTEMS if s in systems], scales


# --------------------------------------------------------------------------- predictions


def boost_formula_key() -> str:
    """``boost`` if the backend's default pipeline groups siblings and fuses norms, else ``btp``."""
    from boost_compiler.options import BoostOptions

    opts = BoostOptions.parse(None)
    names = set(opts.passes)
    grouped = {"group_linears", "online_norm"} <= names and all(
        opts.enabled(n) for n in ("group_linears", "online_norm")
    )
    return "boost" if grouped else "btp"


def predict(system: str, spec: ModelSpec, tp: int) -> dict[str, Any]:
    """Cost-model bytes and collectives of one training step (fp32), forward and backward."""
    from boost_compiler import costmodel as cm

    dims = cm.LlamaDims(
        "bench", spec.d, spec.ff, spec.layers, spec.heads, spec.rank, spec.kv_heads, spec.vocab
    )
    subs = {**dims.values(tp), cm.b: spec.batch, cm.s: spec.seq, cm.e: 4}
    # torch's DTensor plans all-reduce each column-parallel module's input gradient: unfused.
    fs = cm.formulas(fused=False)
    key = boost_formula_key() if system == "boost" else COST_KEY[system]
    f = fs[key]
    extra = cm.BTP_STEP_EXTRA if system == "boost" else (None, None)
    out: dict[str, Any] = {"formula": key}
    for way, layer, ext in (("fwd", f.forward, extra[0]), ("bwd", f.backward, extra[1])):
        nbytes = spec.layers * layer.bytes + (ext.bytes if ext is not None else 0)
        count = spec.layers * layer.count + (ext.count if ext is not None else 0)
        out[f"{way}_bytes"] = int(nbytes.subs(subs))
        out[f"{way}_count"] = int(count.subs(subs))
    out["bytes"] = out["fwd_bytes"] + out["bwd_bytes"]
    out["count"] = out["fwd_count"] + out["bwd_count"]
    head = "vocab-parallel head (all-gather [b,s,d] fwd, all-reduce bwd) + loss and norm stats"
    terms = {"boost": f"L x (7r+2 stats fwd, 7r bwd) + {head}",
             "btp": f"L x (7r+2 stats fwd and bwd) + {head}",
             "standard": "L x (5d+2d_ff fwd, 6d+d_ff bwd)", "dense": "L x (2d fwd, 5d bwd)"}  # fmt: skip
    out["terms"] = terms[key]
    return out


# --------------------------------------------------------------------------- analysis


def _root_cause(r: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's result, its error replaced by the rank that failed first when rank 0's error
    only says that a peer went away (gloo: "Connection closed by peer")."""
    if "Connection closed by peer" not in str(r.get("error", "")):
        return r
    for other in ranks:
        err = str(other.get("error", ""))
        if err and "Connection closed by peer" not in err:
            return {**r, "error": err, "traceback": other.get("traceback", "")}
    return r


def split_group(res: dict[str, Any], members: list[str]) -> dict[str, dict[str, Any]]:
    """One group's spawn result -> per system ``{"sizes": {size: result}, "per_rank": [...]}``."""
    out: dict[str, dict[str, Any]] = {}
    for system in members:
        sizes: dict[str, Any] = {}
        for size, by_system in res.get("sizes", {}).items():
            sizes[size] = _root_cause(by_system.get(system, {"error": "did not run"}), [
                pr.get("sizes", {}).get(size, {}).get(system, {}) for pr in res.get("per_rank", [])
            ])  # fmt: skip
        per_rank = [
            {"rank": pr.get("rank"),
             "sizes": {k: v.get(system, {}) for k, v in pr.get("sizes", {}).items()}}
            for pr in res.get("per_rank", [])
        ]  # fmt: skip
        out[system] = {"sizes": sizes, "per_rank": per_rank, "wall_s": res.get("wall_s")}
        if "error" in res:
            out[system]["error"] = res["error"]
            out[system]["traceback"] = res.get("traceback", "")
    return out


def _stats(times: list[list[float]]) -> dict[str, float]:
    cols = list(zip(*times, strict=True)) if times else [[], [], [], []]
    total = sorted(cols[3])
    q = statistics.quantiles(total, n=4) if len(total) >= 2 else [total[0]] * 3

    def med(i: int) -> float:
        return statistics.median(cols[i])

    return {
        "fwd_s": med(0), "bwd_s": med(1), "opt_s": med(2), "step_s": med(3),
        "p25_s": q[0], "p75_s": q[2], "min_s": total[0], "n": len(total),
    }  # fmt: skip


def analyse(
    results: dict[str, dict[str, Any]], sizes: list[str], tp: int
) -> dict[str, dict[str, Any]]:
    """Per size and system: step statistics, tokens/s, ratios, loss check, comm vs prediction."""
    summary: dict[str, dict[str, Any]] = {}
    for size in sizes:
        rows = {system: _row(system, res, size, tp) for system, res in results.items()}
        _compare_with_eager_and_boost(rows)
        summary[size] = rows
    return summary


def _row(system: str, res: dict[str, Any], size: str, tp: int) -> dict[str, Any]:
    """One system at one size: its error, or its statistics."""
    spec = SIZES[size]
    r = res.get("sizes", {}).get(size)
    if r is None:
        r = {"error": res.get("error", "did not run")}
    row: dict[str, Any] = {"system": system}
    if "error" in r:
        row["error"] = r["error"]
        row["traceback"] = r.get("traceback", res.get("traceback", ""))
        return row
    st = _stats(r["step_times"])
    row.update(st)
    row["tokens_per_s"] = spec.tokens / st["step_s"]
    row["fwd_bwd_s"] = st["fwd_s"] + st["bwd_s"]
    row["first_step_s"] = r["first_step_s"]
    row["parallelize_s"] = r.get("parallelize_s", 0.0)
    row["losses"] = r["losses"]
    row["cache"] = r.get("cache", {})
    if system in TP_SYSTEMS:
        _check_comm(row, r, res, system, size, tp)
    row["top_self_cpu_us"] = r.get("profile", {}).get("top_self_cpu_us", [])
    row["breakdown_ms"] = r.get("profile", {}).get("breakdown_ms", {})
    row["threads"] = r.get("threads")
    row["world"] = r.get("world")
    row["marks_us"] = r.get("profile", {}).get("marks_us", {})
    return row


def _check_comm(
    row: dict[str, Any], r: dict[str, Any], res: dict[str, Any], system: str, size: str, tp: int
) -> None:
    """A TP system's measured communication against the cost model and the plan."""
    pred = predict(system, SIZES[size], tp)
    comm = r.get("comm")
    row["predicted"] = pred
    row["plan"] = r.get("plan_comm")
    if comm:
        row["comm"] = comm
        row["bytes_match"] = comm["bytes"] == pred["bytes"] and (
            comm["fwd"]["bytes"] == pred["fwd_bytes"] and comm["bwd"]["bytes"] == pred["bwd_bytes"]
        )
        row["count_match"] = comm["count"] == pred["count"]
        if row["plan"]:
            plan = row["plan"]
            row["plan_match"] = comm["fwd"]["bytes"] == plan["fwd_bytes"] and (
                comm["bwd"]["bytes"] == plan["bwd_bytes"]
            )
        counts = {
            pr.get("sizes", {}).get(size, {}).get("comm", {}).get("count")
            for pr in res.get("per_rank", [])
        }
        row["ranks_agree"] = len(counts) == 1
    row["fallbacks"] = r.get("fallbacks", [])


def _compare_with_eager_and_boost(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's loss distance to 1-process eager and its step time over BOOST's."""
    eager = rows.get("eager", {}).get("losses")
    boost = rows.get("boost", {})
    for system, row in rows.items():
        if "error" in row:
            continue
        if eager and system != "dtensor-dense":
            n = min(len(eager), len(row["losses"]))
            row["loss_vs_eager"] = max(
                abs(a - b) / max(abs(b), 1e-12)
                for a, b in zip(row["losses"][:n], eager[:n], strict=True)
            )
        if "step_s" in boost:
            row["boost_speedup"] = row["step_s"] / boost["step_s"]
            row["boost_speedup_fwd_bwd"] = row["fwd_bwd_s"] / boost["fwd_bwd_s"]


# --------------------------------------------------------------------------- tables


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("[green]yes[/]" if ok else "[bold red]NO[/]")


def comm_table(summary: dict[str, dict[str, Any]], tp: int) -> Any:
    from rich.table import Table

    t = Table(
        title=f"Communication per training step (fwd+bwd), tp={tp}, fp32: measured (profiler "
        "gloo:* events, rank 0) vs predicted (cost model; BOOST also: parallelize's plan)",
        title_justify="left",
        caption="bytes: logical collective size (all-reduce: the tensor; all-gather: the gathered "
        "tensor), the cost model's payload convention. coll.: collectives fwd+bwd. "
        "vs boost: measured bytes over BOOST's.",
        caption_justify="left",
    )
    cols = ("size", "system", "coll. measured", "coll. predicted", "bytes measured",
            "bytes predicted", "bytes (plan)", "MiB/step", "match", "vs boost")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c in ("size", "system") else "right")
    for size, rows in summary.items():
        tp_rows = [(s, r) for s, r in rows.items() if s in TP_SYSTEMS]
        boost_bytes = rows.get("boost", {}).get("comm", {}).get("bytes")
        for i, (system, r) in enumerate(tp_rows):
            first = size if i == 0 else ""
            last = i == len(tp_rows) - 1
            if "error" in r or "comm" not in r:
                t.add_row(first, system, "[red]failed[/]", *["-"] * 7, end_section=last)
                continue
            c, p, plan = r["comm"], r["predicted"], r.get("plan")
            ok = r["bytes_match"] and r.get("plan_match", True)
            t.add_row(
                first,
                system,
                f"{c['fwd']['count']}+{c['bwd']['count']}",
                f"{p['fwd_count']}+{p['bwd_count']}",
                f"{c['fwd']['bytes']:,}+{c['bwd']['bytes']:,}",
                f"{p['fwd_bytes']:,}+{p['bwd_bytes']:,}",
                f"{plan['fwd_bytes']:,}+{plan['bwd_bytes']:,}" if plan else "-",
                f"{c['bytes'] / 2**20:.2f}",
                _mark(ok),
                f"{c['bytes'] / boost_bytes:.2f}x" if boost_bytes else "-",
                end_section=last,
            )
    return t


def time_table(summary: dict[str, dict[str, Any]], tp: int) -> Any:
    from rich.table import Table

    t = Table(
        title=f"Training step time (fwd + bwd + AdamW), compiled; tensor-parallel systems on "
        f"{tp} processes, median [25-75%]",
        title_justify="left",
        caption="procs x thr: processes x threads each. BOOST speed-up: the system's median step time over BOOST's (> 1: BOOST is "
        "faster); fwd+bwd: the same without the optimizer. first step: compile + first step. "
        "loss vs eager: largest relative loss difference over all steps against 1-process "
        "eager (same model, batches and optimizer; the dense model differs).",
        caption_justify="left",
    )
    cols = ("size", "system", "procs x thr", "ms/step", "fwd ms", "bwd ms", "opt ms", "tokens/s",
            "BOOST speed-up", "(fwd+bwd)", "first step s", "loss vs eager")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c in ("size", "system") else "right")
    for size, rows in summary.items():
        items = list(rows.items())
        for i, (system, r) in enumerate(items):
            first = f"{size} ({_size_label(size)})" if i == 0 else ""
            last = i == len(items) - 1
            if "error" in r:
                t.add_row(first, system, "-", f"[red]failed: {escape(r['error'][:60])}[/]", *["-"] * 8,
                          end_section=last)  # fmt: skip
                continue
            sp = r.get("boost_speedup")
            spf = r.get("boost_speedup_fwd_bwd")
            le = r.get("loss_vs_eager")
            t.add_row(
                first,
                system,
                f"{r.get('world')} x {r.get('threads')}",
                f"{r['step_s'] * 1e3:.1f} [{r['p25_s'] * 1e3:.1f}-{r['p75_s'] * 1e3:.1f}]",
                f"{r['fwd_s'] * 1e3:.1f}",
                f"{r['bwd_s'] * 1e3:.1f}",
                f"{r['opt_s'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                "-" if sp is None else f"{sp:.2f}x",
                "-" if spf is None else f"{spf:.2f}x",
                f"{r['first_step_s']:.1f}",
                "-" if le is None else f"{le:.1e}",
                end_section=last,
            )
    return t


def breakdown_table(summary: dict[str, dict[str, Any]]) -> Any:
    from rich.table import Table

    from .training import CATEGORIES

    cats = [c for c, _ in CATEGORIES] + ["other", "total"]
    t = Table(
        title="Where the time goes: one profiled step (fwd+bwd+AdamW) on rank 0, self CPU ms",
        title_justify="left",
        caption="collectives: issuing the all-reduces/all-gathers and waiting for them (with "
        "gloo on one core per rank, the wait includes the other rank's lag); Inductor kernels: "
        "inside compiled graphs, outside ATen ops; other: Python, dispatch, DTensor, autograd. "
        "One step under the profiler: indicative, slower than the timed steps.",
        caption_justify="left",
    )
    for c in ["size", "system", *cats]:
        t.add_column(c, justify="left" if c in ("size", "system") else "right")
    for size, rows in summary.items():
        items = [(s, r) for s, r in rows.items() if r.get("breakdown_ms")]
        for i, (system, r) in enumerate(items):
            b = r["breakdown_ms"]
            t.add_row(size if i == 0 else "", system, *(f"{b.get(c, 0):.0f}" for c in cats),
                      end_section=i == len(items) - 1)  # fmt: skip
    return t


def _size_label(size: str) -> str:
    s = SIZES[size]
    return f"d={s.d}, d_ff={s.ff}, r={s.rank}, L={s.layers}, b={s.batch}, s={s.seq}"


def ratio_lines(summary: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for size, rows in summary.items():
        parts = []
        for system in ("dtensor-lowrank", "dtensor-dense", "inductor", "eager"):
            sp = rows.get(system, {}).get("boost_speedup")
            spf = rows.get(system, {}).get("boost_speedup_fwd_bwd")
            if sp is not None:
                parts.append(f"vs {system} {sp:.2f}x (fwd+bwd {spf:.2f}x)")
        if parts:
            out.append(f"{size}: BOOST step time " + ", ".join(parts))
    return out


# --------------------------------------------------------------------------- charts


def plots(summary: dict[str, dict[str, Any]], gemm: list[dict[str, Any]], out: Path) -> list[str]:
    """PNG charts; an empty list (and one message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: PNG charts skipped "
            "(pip install matplotlib, or the package's [bench] extra)"
        )
        return []
    files = []
    if any("comm" in r for rows in summary.values() for r in rows.values()):
        files.append(_save(plt, _comm_chart(plt, summary), out / "comm_per_step.png"))
    if any("step_s" in r for rows in summary.values() for r in rows.values()):
        files.append(_save(plt, _step_time_chart(plt, summary), out / "step_time.png"))
    if gemm:
        files.append(_save(plt, _gemm_chart(plt, gemm), out / "gemm.png"))
    return files


def _save(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _comm_chart(plt: Any, summary: dict[str, dict[str, Any]]) -> Any:
    """Per size: the TP systems' measured MiB per step (bars), the cost model's (marks)."""
    sizes = list(summary)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        rows = summary[size]
        names = [s for s in TP_SYSTEMS if "comm" in rows.get(s, {})]
        meas = [rows[s]["comm"]["bytes"] / 2**20 for s in names]
        pred = [rows[s]["predicted"]["bytes"] / 2**20 for s in names]
        ax.bar(names, meas, color=["tab:green", "tab:red", "tab:gray"][: len(names)])
        ax.scatter(names, pred, marker="_", s=900, color="black", label="cost model", zorder=3)
        for x, v in enumerate(meas):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{size}: {_size_label(size)}", fontsize=8)
        ax.set_ylabel("MiB per training step (fwd+bwd)")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Communication per step, measured (bars) vs cost model")
    return fig


def _step_time_chart(plt: Any, summary: dict[str, dict[str, Any]]) -> Any:
    """Per size: every system's median step time and tokens/s."""
    sizes = list(summary)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    colors = {"boost": "tab:green", "dtensor-lowrank": "tab:red",
              "dtensor-dense": "tab:gray", "inductor": "tab:blue", "eager": "tab:orange"}  # fmt: skip
    for ax, size in zip(axes[0], sizes, strict=True):
        rows = summary[size]
        names = [s for s in SYSTEMS if "step_s" in rows.get(s, {})]
        ms = [rows[s]["step_s"] * 1e3 for s in names]
        ax.bar(names, ms, color=[colors[s] for s in names])
        for x, s in enumerate(names):
            ax.text(x, ms[x], f"{ms[x]:.0f} ms\n{rows[s]['tokens_per_s']:,.0f} tok/s",
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_ylim(0, max(ms, default=1) * 1.25)
        ax.set_title(f"{size}: {_size_label(size)}", fontsize=8)
        ax.set_ylabel("median step time (ms), lower is better")
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle("Training step time (fwd+bwd+AdamW), compiled")
    return fig


def _gemm_chart(plt: Any, gemm: list[dict[str, Any]]) -> Any:
    """Per GEMM scale: each strategy's achieved GFLOP/s, labelled with its intensity."""
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(gemm)), 4))
    strategies = list(gemm[0]["strategies"])
    width = 0.8 / len(strategies)
    for j, name in enumerate(strategies):
        xs = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(gemm))]
        vals = [g["strategies"][name]["gflops"] for g in gemm]
        ax.bar(xs, vals, width, label=name)
        for x, g, v in zip(xs, gemm, vals, strict=True):
            ax.text(x, v, f"{g['strategies'][name]['intensity']:.0f}", ha="center",
                    va="bottom", fontsize=6)  # fmt: skip
    ax.set_xticks(range(len(gemm)))
    ax.set_xticklabels([f"{g['scale']}\nd={g['d']} r={g['rank']} M={g['M']}" for g in gemm])
    ax.set_ylabel(f"achieved GFLOP/s ({gemm[0]['dtype']}, {gemm[0]['threads']} thread(s))")
    ax.set_title(f"GEMM microbench, tp={gemm[0]['tp']}: one layer's forward GEMMs per rank "
                 "(labels: FLOP/B)", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------- main


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("boost-compiler")
    except PackageNotFoundError:
        return ""


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
                {"systems": members, "specs": specs, "steps": args.steps, "warmup": args.warmup},
                timeout_s=args.timeout, threads=threads, tag=tag, log_dir=out / "logs",
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
    console.print(time_table(summary, args.tp))
    console.print(breakdown_table(summary))
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
