"""GEMM microbench: one layer's projections as each tensor-parallel strategy computes them per rank.

The same logical layer (q, k, v, o, gate, up, down; each a low-rank bottleneck d_in -> r ->
d_out, or a dense d_in -> d_out) is run as the per-rank GEMMs ``[M, K] @ [K, N]`` (M = b*s)
of each strategy, with the shapes of the cost model (``boost_compiler.costmodel``):

- ``dense``: Megatron on the dense model (K = d or N = d/p);
- ``standard``: Megatron on each factor pair, split along r: the down factor ``[M, d] @
  [d, r/p]`` and the up factor ``[M, r/p] @ [r/p, d]`` (K = r/p: low arithmetic intensity);
- ``btp``: bottleneck-aware TP: ``[M, d/p] @ [d/p, r]`` and ``[M, r] @ [r, d/p]`` (K = d/p, r);
- ``boost``: BTP with the sibling down factors grouped (q/k/v: N = 3r, gate/up: N = 2r).

Standard TP and BTP do the same FLOPs per rank; the difference is the shape. Reported per
strategy: FLOPs, time (sum over the layer's GEMMs of each one's best time), achieved GFLOP/s
and arithmetic intensity (FLOP-weighted, ``2MKN / (e (MK + KN + MN))``, the cost model's).
Forward GEMMs only.

    python -m boost_compiler.bench.gemm             # the CPU scales, fp32, 1 thread
    python -m boost_compiler.bench.gemm --scales 7b --tp 4 --batch 1 --seq 4096 --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import costmodel as cm
from ..device import pick_device

STRATEGIES = ("dense", "standard", "btp", "boost")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Scale:
    """One layer size and micro-batch: M = batch * seq tokens per rank."""

    name: str
    dims: cm.LlamaDims
    batch: int
    seq: int

    @property
    def m(self) -> int:
        return self.batch * self.seq


def _dims(name: str, d: int, ff: int, r: int, heads: int) -> cm.LlamaDims:
    return cm.LlamaDims(name, d, ff, 1, heads, r)


# CPU scales: the two `boost bench` sizes and one 2x wider. GPU: the paper's 7B (b=1, s=4096).
SCALES: dict[str, Scale] = {
    "tiny": Scale("tiny", _dims("tiny", 64, 172, 16, 4), 2, 32),
    "small": Scale("small", _dims("small", 256, 688, 64, 4), 2, 64),
    "large": Scale("large", _dims("large", 512, 1376, 128, 8), 4, 256),
    "xl": Scale("xl", _dims("xl", 1024, 2752, 256, 16), 4, 256),
    "1b": Scale("1b", cm.CONFIGS["1b"], 1, 4096),
    "7b": Scale("7b", cm.CONFIGS["7b"], 1, 4096),
}
CPU_SCALES = ("small", "large", "xl")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_mm(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    min_time: float = 0.02,
    repeats: int = 5,
) -> float:
    """Seconds of one ``[m, k] @ [k, n]`` (``torch.mm`` into a preallocated output).

    The best of ``repeats`` samples of ``min_time`` seconds each (timeit's advice: on a shared
    machine the slower samples measure the neighbours, not the kernel).
    """
    gen = torch.Generator().manual_seed(0)  # the default (CPU) generator: the same data anywhere
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    c = torch.empty(m, n, device=device, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up (library initialisation, kernel selection)
    _sync(device)
    t0 = time.perf_counter()
    torch.mm(a, b, out=c)
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    iters = max(1, min(10_000, int(min_time / once)))
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=c)
        _sync(device)
        samples.append((time.perf_counter() - t0) / iters)
    return min(samples)


def bench_scale(
    scale: Scale,
    tp: int,
    dtype: str = "fp32",
    device: str | None = None,
    min_time: float = 0.02,
    strategies: tuple[str, ...] = STRATEGIES,
) -> dict[str, Any]:
    """Every strategy's per-rank GEMMs of one layer at ``scale``: times, GFLOP/s, intensity."""
    report = cm.cost(scale.dims, tp, scale.batch, scale.seq, dtype)
    dev = torch.device(device) if device is not None else pick_device()
    cache: dict[tuple[int, int, int], float] = {}
    out: dict[str, Any] = {
        "scale": scale.name,
        "d": scale.dims.d,
        "d_ff": scale.dims.d_ff,
        "rank": scale.dims.rank,
        "tp": tp,
        "M": scale.m,
        "dtype": dtype,
        "device": device,
        "strategies": {},
    }
    for name in strategies:
        sc = report.strategies[name]
        rows = []
        for g in sc.gemms:
            key = (g.M, g.K, g.N)
            if key not in cache:
                cache[key] = time_mm(g.M, g.K, g.N, TORCH_DTYPES[dtype], dev, min_time)
            t = cache[key]
            rows.append(
                {"name": g.name, "M": g.M, "K": g.K, "N": g.N, "flops": g.flops, "seconds": t,
                 "gflops": g.flops / t / 1e9, "intensity": g.intensity}
            )  # fmt: skip
        flops = sum(r["flops"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        out["strategies"][name] = {
            "title": sc.title,
            "flops": flops,
            "seconds": seconds,
            "gflops": flops / seconds / 1e9,
            "intensity": sc.intensity,
            "min_k": min(r["K"] for r in rows),
            "gemms": rows,
        }
    return out


def run(
    scales: list[str],
    tp: int = 2,
    dtype: str = "fp32",
    device: str | None = None,
    threads: int | None = None,
    min_time: float = 0.02,
    batch: int | None = None,
    seq: int | None = None,
) -> list[dict[str, Any]]:
    """:func:`bench_scale` for each named scale (``batch``/``seq`` override the scale's)."""
    if threads:
        torch.set_num_threads(threads)
    results = []
    for name in scales:
        if name not in SCALES:
            raise KeyError(f"unknown GEMM scale {name!r}; choose from {', '.join(SCALES)}")
        sc = SCALES[name]
        if batch or seq:
            sc = Scale(sc.name, sc.dims, batch or sc.batch, seq or sc.seq)
        res = bench_scale(sc, tp, dtype, device, min_time)
        res["threads"] = torch.get_num_threads()
        results.append(res)
    return results


def table(results: list[dict[str, Any]], peak_tflops: float | None = None) -> Any:
    """A rich table: one row per scale and strategy."""
    from rich.table import Table

    first = results[0] if results else {}
    t = Table(
        title=f"GEMM microbench: one layer's forward GEMMs per rank, tp={first.get('tp')}, "
        f"{first.get('dtype')} on {first.get('device')} ({first.get('threads')} thread(s))",
        title_justify="left",
        caption="Same FLOPs for standard and BTP; min K: the smallest reduction dimension "
        "(standard TP: r/p). FLOP/B: arithmetic intensity 2MKN/(e(MK+KN+MN)), FLOP-weighted. "
        "vs standard: achieved GFLOP/s over standard TP's.",
        caption_justify="left",
    )
    cols = ["scale (d/d_ff/r, M)", "strategy", "GEMMs", "min K", "GFLOP", "ms", "GFLOP/s"]
    if peak_tflops:
        cols.append("% of peak")
    cols += ["FLOP/B", "vs standard"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("scale (d/d_ff/r, M)", "strategy") else "right")
    for res in results:
        std = res["strategies"].get("standard")
        label = f"{res['scale']} ({res['d']}/{res['d_ff']}/{res['rank']}, {res['M']})"
        for i, (name, s) in enumerate(res["strategies"].items()):
            row = [
                label if i == 0 else "",
                name,
                str(len(s["gemms"])),
                str(s["min_k"]),
                f"{s['flops'] / 1e9:.3f}",
                f"{s['seconds'] * 1e3:.3f}",
                f"{s['gflops']:,.1f}",
            ]
            if peak_tflops:
                row.append(f"{s['gflops'] / (peak_tflops * 1e3) * 100:.1f}%")
            row += [
                f"{s['intensity']:,.1f}",
                f"{s['gflops'] / std['gflops']:.2f}x" if std else "-",
            ]
            t.add_row(*row, end_section=i == len(res["strategies"]) - 1)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--scales", default=",".join(CPU_SCALES), help=f"from {', '.join(SCALES)}")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=list(TORCH_DTYPES))
    ap.add_argument(
        "--device", default=None, help="torch device (default: the accelerator, else the CPU)"
    )
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one TP rank's share)")
    ap.add_argument("--batch", type=int, default=None, help="override each scale's batch")
    ap.add_argument("--seq", type=int, default=None, help="override each scale's seq")
    ap.add_argument("--min-time", type=float, default=0.02, help="seconds per timing sample")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    from rich.console import Console

    results = run(
        [s for s in args.scales.split(",") if s], args.tp, args.dtype, args.device,
        args.threads, args.min_time, args.batch, args.seq,
    )  # fmt: skip
    Console(width=160).print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
