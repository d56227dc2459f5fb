"""The median over several ``boost bench`` runs: efficiency, ratios to BOOST, step parts.

    python benchmarks/bench_median.py bench-results/A bench-results/B bench-results/C

Each argument is a run's folder (or its ``results.json``). Per size and system: the median
over the runs of the median step, of the parallel efficiency, of BOOST's speed-up over the
system, of the worst rank's GEMM time and other compute over one process's (``inductor``,
same run and size), and of each part of the step breakdown (the slowest rank's), with each
run's value beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from boost_compiler.bench.breakdown import PARTS


def load(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        f = Path(p)
        if f.is_dir():
            found = sorted(f.glob("**/results.json"))
            if not found:
                raise SystemExit(f"no results.json under {f}")
            f = found[-1]
        out.append(json.loads(f.read_text())["summary"])
    return out


def figures(row: dict[str, Any], one: dict[str, Any] | None = None) -> dict[str, float | None]:
    """A system's figures in one run; ``one``: the same run's one-process Inductor row of
    the same size, for the slowest rank's other compute over one process's ("other/1p")."""
    b = row.get("breakdown", {}).get("max", {})
    base = ((one or {}).get("breakdown") or {}).get("max", {}).get("other compute")
    other = b.get("other compute")
    return {
        "ms/step": row["step_s"] * 1e3,
        "par. eff.": row.get("efficiency"),
        "BOOST faster by": row.get("boost_speedup"),
        "GEMM/1p": row.get("gemm_vs_single"),
        "other/1p": other / base if other is not None and base else None,
        **{p: b.get(p) for p in PARTS},
    }


def median_table(runs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title=f"median of {len(runs)} runs (each run's value in brackets)",
              title_justify="left")  # fmt: skip
    names = list(figures({"step_s": 0}))
    for c in ["size", "system", *names]:
        t.add_column(c, justify="left" if c in ("size", "system") else "right")
    for size in runs[0]:
        for system in runs[0][size]:
            rows = [(r[size][system], r[size].get("inductor")) for r in runs
                    if "step_s" in r.get(size, {}).get(system, {})]  # fmt: skip
            if not rows:
                continue
            cells = []
            for name in names:
                vals = [v for r, one in rows if (v := figures(r, one)[name]) is not None]
                if not vals:
                    cells.append("")
                    continue
                fmt = "{:.0f}" if name == "ms/step" or name in PARTS else "{:.2f}"
                each = ", ".join(fmt.format(v) for v in vals)
                cells.append(f"{fmt.format(statistics.median(vals))} [{each}]")
            t.add_row(size, system, *cells)
    return t


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("runs", nargs="+", help="boost bench output folders or results.json files")
    args = ap.parse_args(argv)
    Console(width=250).print(median_table(load(args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
