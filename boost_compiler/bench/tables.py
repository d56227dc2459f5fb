"""The console tables of ``boost bench`` (rich), from :func:`.suite.analyse`'s summary.

Every table holds every size, one section per size; ``boost bench`` prints them and saves
the console's text as ``tables.txt``.
"""

from __future__ import annotations

from typing import Any

from .analysis import SIZES
from .training import TP_SYSTEMS

MIB = 2**20


def escape(text: str) -> str:
    """``text`` shown literally in rich markup (errors quote ``[file:line]``)."""
    from rich.markup import escape as _escape

    return _escape(text)


def size_label(size: str) -> str:
    s = SIZES[size]
    return f"d={s.d}, d_ff={s.ff}, r={s.rank}, L={s.layers}, V={s.vocab}, b={s.batch}, s={s.seq}"


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("[green]yes[/]" if ok else "[bold red]NO[/]")


def comm_table(summary: dict[str, dict[str, Any]], tp: int) -> Any:
    from rich.table import Table

    t = Table(
        title=f"Communication per training step (fwd+bwd), tp={tp}, fp32: measured (profiler "
        "gloo:* events, rank 0) vs predicted (cost model; torchtitan plans: bench.peers.predict; "
        "BOOST also: parallelize's plan)",
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
            first = f"{size} ({size_label(size)})" if i == 0 else ""
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
    """Each system's step on each rank split into parts that add up to it (ms)."""
    from rich.table import Table

    from .breakdown import PARTS, clock_note, within

    ranks = [b for rows in summary.values() for r in rows.values()
             for b in (r.get("breakdown") or {}).get("ranks", [])]  # fmt: skip
    note = clock_note(ranks)
    t = Table(
        title="Where a step's time goes, per rank (ms of the main CPU thread): the profiled "
        "step of median wall time, beside the timed median",
        title_justify="left",
        caption=(f"[red]{note}.[/] " if note else "")
        + "GEMM: aten mm/bmm/addmm; other compute: every other op, attention and the "
        "compiled graphs' fused kernels; exposed comm: time the rank's main thread spends "
        "issuing or waiting in collectives (the backend's own threads are not counted: what "
        "remains is what was not overlapped); overhead: Python, guards, dispatch, autograd. "
        "sum: the parts over the timed median step (ok within 5%). GEMM/1p: the rank's GEMM "
        "time over one process's (inductor).",
        caption_justify="left",
    )
    cols = ["size", "system", "rank", "timed", *PARTS, "sum", "GEMM/1p"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("size", "system") else "right")
    for size, rows in summary.items():
        items = [(s, r) for s, r in rows.items() if r.get("breakdown")]
        for i, (system, r) in enumerate(items):
            one = rows.get("inductor", {}).get("breakdown", {}).get("max", {}).get("GEMM")
            for k, b in enumerate(r["breakdown"]["ranks"]):
                total = sum(b[p] for p in PARTS)
                ok = within(b)
                t.add_row(
                    size if i == 0 and k == 0 else "", system if k == 0 else "", str(k),
                    f"{b['timed_ms']:.0f}", *(f"{b[p]:.0f}" for p in PARTS),
                    f"[{'green' if ok else 'yellow'}]{total / b['timed_ms']:.0%}[/]",
                    f"{b['GEMM'] / one:.2f}" if one else "",
                    end_section=i == len(items) - 1 and k == len(r["breakdown"]["ranks"]) - 1,
                )  # fmt: skip
    return t


def kinds_table(summary: dict[str, dict[str, Any]]) -> Any:
    """Each tensor-parallel system's step by kind of work, per rank, against one process's
    (Inductor): the parts of "other compute" that do not halve (issue 45)."""
    from rich.table import Table

    from .breakdown import ratio_rows

    t = Table(
        title="A rank's step by kind of work against one process's (ms of self time, the "
        "profiled step of median wall time; by op and compiled-kernel name)",
        title_justify="left",
        caption="one: the 1-process Inductor run; ratio: each kind's slowest rank over one "
        "process (0.50 halves at tp=2). Kinds from the names of ATen ops and of Inductor's fused "
        "kernels (bench/breakdown.py KINDS): a fused kernel counts once, under its first "
        "matching kind; other: what matches none.",
        caption_justify="left",
    )
    found = {}
    for size, rows in summary.items():
        one = _all_kinds(rows.get("inductor", {}))[:1]
        ranked = [(s, _all_kinds(r)) for s, r in rows.items() if s in TP_SYSTEMS]
        found[size] = [(s, one[0], ks) for s, ks in ranked if ks and one]
    width = max((len(ks) for items in found.values() for _, _, ks in items), default=0)
    for c in ("size", "system", "kind", "one", *(f"rank {k}" for k in range(width)), "ratio"):
        t.add_column(c, justify="left" if c in ("size", "system", "kind") else "right")
    for size, items in found.items():
        for i, (system, one, ranks) in enumerate(items):
            body = ratio_rows(one, ranks)
            for k, row in enumerate(body):
                pad = ("",) * (width - len(ranks))
                t.add_row(size if i == 0 and k == 0 else "", system if k == 0 else "",
                          *row[:-1], *pad, row[-1], end_section=k == len(body) - 1)  # fmt: skip
    return t


def _all_kinds(row: dict[str, Any]) -> list[dict[str, float]]:
    return [b["kinds"] for b in (row.get("breakdown") or {}).get("ranks", []) if "kinds" in b]


def ratio_lines(summary: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for size, rows in summary.items():
        parts = []
        for system in [s for s in rows if s != "boost"]:
            sp = rows.get(system, {}).get("boost_speedup")
            spf = rows.get(system, {}).get("boost_speedup_fwd_bwd")
            if sp is not None:
                parts.append(f"vs {system} {sp:.2f}x (fwd+bwd {spf:.2f}x)")
        if parts:
            out.append(f"{size}: BOOST step time " + ", ".join(parts))
    return out


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def summary_table(summary: dict[str, dict[str, Any]], tp: int) -> Any:
    """Per size and system: speed, per-rank memory and parallel efficiency, each vs BOOST."""
    from rich.table import Table

    t = Table(
        title=f"Per system: step time, throughput, per-rank memory and parallel efficiency "
        f"(tensor-parallel systems on {tp} processes)",
        title_justify="left",
        caption="sizes: see the next table. ms/step: median step (fwd+bwd+AdamW), the slowest rank's. par. eff.: "
        "T(1 process, Inductor) / (processes x T(system)). vs BOOST: the system's figure over "
        "BOOST's (time > 1: BOOST is faster; memory > 1: BOOST holds less). state/rank: bytes "
        "the rank holds of parameters + gradients + AdamW exp_avg/exp_avg_sq, read off its "
        "local tensors (DTensor: .to_local()). peak/rank: CPU tensor memory, not RSS: the "
        "parameters and AdamW state live at the step's start + the peak of the step's own "
        "allocations in torch.profiler's memory records (profile_memory=True; one profiled "
        "step), the largest over the ranks.",
        caption_justify="left",
    )
    cols = ("size", "system", "procs", "ms/step", "tokens/s", "vs BOOST", "par. eff.",
            "state/rank MiB", "(params / grads / AdamW)", "vs BOOST ", "peak/rank MiB",
            "vs BOOST  ")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c in ("size", "system") else "right")
    for size, rows in summary.items():
        items = list(rows.items())
        boost_mem = rows.get("boost", {}).get("memory", {})
        for i, (system, r) in enumerate(items):
            first = size if i == 0 else ""
            last = i == len(items) - 1
            if "error" in r:
                t.add_row(first, system, "-", "[red]failed[/]", *["-"] * (len(cols) - 4),
                          end_section=last)  # fmt: skip
                continue
            m = r.get("memory", {})
            eff = r.get("efficiency")
            parts = " / ".join(_mib(m.get(k)) for k in ("param_bytes", "grad_bytes", "adamw_bytes"))
            t.add_row(
                first,
                system,
                str(r.get("world")),
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                "-" if r.get("boost_speedup") is None else f"{r['boost_speedup']:.2f}x",
                "-" if eff is None else f"{eff:.2f}",
                _mib(m.get("state_bytes")),
                parts,
                _ratio(m.get("state_bytes"), boost_mem.get("state_bytes")),
                _mib(m.get("peak_bytes")),
                _ratio(m.get("peak_bytes"), boost_mem.get("peak_bytes")),
                end_section=last,
            )
    return t
