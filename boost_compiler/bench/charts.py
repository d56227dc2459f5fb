"""The PNG charts of ``boost bench`` (matplotlib, optional: the ``[bench]`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tables import size_label
from .training import SYSTEMS, TP_SYSTEMS

COLORS = {"boost": "tab:green", "dtensor-lowrank": "tab:red", "dtensor-dense": "tab:gray",
          "dtensor-lowrank-nosp": "tab:pink", "dtensor-dense-nosp": "tab:brown",
          "inductor": "tab:blue", "eager": "tab:orange"}  # fmt: skip


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
    if any("breakdown" in r for rows in summary.values() for r in rows.values()):
        files.append(_save(plt, _breakdown_chart(plt, summary), out / "step_breakdown.png"))
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
        ax.bar(names, meas, color=[COLORS.get(s, "tab:purple") for s in names])
        ax.scatter(names, pred, marker="_", s=900, color="black", label="cost model", zorder=3)
        for x, v in enumerate(meas):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{size}: {size_label(size)}", fontsize=8)
        ax.set_ylabel("MiB per training step (fwd+bwd)")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Communication per step, measured (bars) vs cost model")
    return fig


def _step_time_chart(plt: Any, summary: dict[str, dict[str, Any]]) -> Any:
    """Per size: every system's median step time and tokens/s."""
    sizes = list(summary)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        rows = summary[size]
        names = [s for s in SYSTEMS if "step_s" in rows.get(s, {})]
        ms = [rows[s]["step_s"] * 1e3 for s in names]
        ax.bar(names, ms, color=[COLORS.get(s, "tab:purple") for s in names])
        for x, s in enumerate(names):
            ax.text(x, ms[x], f"{ms[x]:.0f} ms\n{rows[s]['tokens_per_s']:,.0f} tok/s",
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_ylim(0, max(ms, default=1) * 1.25)
        ax.set_title(f"{size}: {size_label(size)}", fontsize=8)
        ax.set_ylabel("median step time (ms), lower is better")
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle("Training step time (fwd+bwd+AdamW), compiled")
    return fig


def _breakdown_chart(plt: Any, summary: dict[str, dict[str, Any]]) -> Any:
    """Per size: each system's step on each rank as stacked parts (ms), the timed step marked."""
    from .breakdown import PARTS

    sizes = list(summary)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        bars = [
            (f"{s}\nrank {k}" if len(r["breakdown"]["ranks"]) > 1 else s, b)
            for s in SYSTEMS if (r := summary[size].get(s, {})).get("breakdown")
            for k, b in enumerate(r["breakdown"]["ranks"])
        ]  # fmt: skip
        bottom = [0.0] * len(bars)
        for part in PARTS:
            vals = [b[part] for _, b in bars]
            ax.bar([n for n, _ in bars], vals, bottom=bottom, label=part)
            bottom = [x + v for x, v in zip(bottom, vals, strict=True)]
        ax.scatter([n for n, _ in bars], [b["timed_ms"] for _, b in bars], marker="_", s=600,
                   color="black", label="timed step (median)", zorder=3)  # fmt: skip
        ax.set_title(f"{size}: {size_label(size)}", fontsize=8)
        ax.set_ylabel("ms per step")
        ax.tick_params(axis="x", labelsize=6, rotation=30)
        ax.legend(fontsize=6)
    fig.suptitle("Where a step's time goes, per rank")
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
