"""``boost cost``: the cost model's per-layer communication, GEMM intensity and estimate."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from . import Command

if TYPE_CHECKING:  # the cost model is imported when `cost` runs
    from ..costmodel import CostReport, Gemm


def _cost_arguments(p: argparse.ArgumentParser) -> None:
    from ..costmodel import CONFIGS, DTYPE_BYTES, Link

    p.add_argument("--config", default="7b", help=f"model size: {', '.join(CONFIGS)}")
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel degree p")
    p.add_argument("--batch", type=int, default=4, help="micro-batch b")
    p.add_argument("--seq", type=int, default=4096, help="sequence length s")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPE_BYTES))
    for flag, field in (("--d", "d"), ("--d-ff", "d_ff"), ("--rank", "rank"),
                        ("--heads", "n_heads"), ("--kv-heads", "n_kv_heads"),
                        ("--layers", "n_layers")):  # fmt: skip
        p.add_argument(flag, type=int, dest=f"dim_{field}", help=f"override the config's {field}")
    p.add_argument(
        "--bandwidth-gbps", type=float, default=Link.bandwidth_gbps,
        help="link bandwidth per direction in GB/s (1e9 bytes/s) for the alpha-beta estimate",
    )  # fmt: skip
    p.add_argument(
        "--latency-us", type=float, default=Link.latency_us,
        help="latency per ring step in microseconds (a ring all-reduce has 2(p-1) steps)",
    )  # fmt: skip
    p.add_argument(
        "--ridge", type=float, default=156.0,
        help="GPU ridge point in FLOP/byte below which a GEMM is memory bound "
        "(default: A100 bf16, 312 TFLOP/s / 2.0 TB/s)",
    )  # fmt: skip
    p.add_argument(
        "--unfused", action="store_true",
        help="one backward all-reduce per column-parallel module (torch DTensor plans) "
        "instead of Megatron's fused QKV / gate-up",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print a JSON object instead of tables")


def _cost_run(args: argparse.Namespace) -> int:
    from ..costmodel import Link, cost, get_config

    dims = get_config(args.config)
    overrides = {
        k.removeprefix("dim_"): v for k, v in vars(args).items() if k.startswith("dim_") and v
    }
    if overrides:
        dims = replace(dims, name=f"{dims.name}*", **overrides)
    link = Link(args.bandwidth_gbps, args.latency_us)
    report = cost(dims, args.tp, args.batch, args.seq, args.dtype, link, fused=not args.unfused)
    if args.json:
        print(json.dumps(cost_json(report, args.ridge), indent=2))
        return 0
    console = Console()
    for table in (_comm_table(report), _lowrank_gemm_table(report, args.ridge),
                  _dense_gemm_table(report, args.ridge)):  # fmt: skip
        console.print(table)
    return 0


def cost_json(report: CostReport, ridge: float) -> dict[str, Any]:
    """The report as plain JSON; ``per_layer.forward.btp_mib`` etc. use BOOST's convention."""
    from ..costmodel import DTYPE_BYTES, MIB, ratios

    out: dict[str, Any] = {
        "config": {**asdict(report.dims), "n_kv_heads": report.dims.kv_heads},
        "tp": report.tp, "batch": report.batch, "seq": report.seq, "dtype": report.dtype,
        "bytes_per_element": DTYPE_BYTES[report.dtype], "fused_column_inputs": report.fused,
        "convention": "payload = size of the all-reduced tensor (not ring traffic), "
        "MiB = 2**20 B; *_mib: activation payloads (BOOST's convention); *_total_mib adds "
        "the fp32 norm statistics; *_time_us_estimate: ring alpha-beta ESTIMATE",
        "link_estimate": asdict(report.link), "ridge_flop_per_byte": ridge,
    }  # fmt: skip
    per_layer: dict[str, dict[str, Any]] = {"forward": {}, "backward": {}}
    for n, c in report.strategies.items():
        for way, comm in (("forward", c.forward), ("backward", c.backward)):
            per_layer[way].update({
                f"{n}_mib": comm.mib, f"{n}_total_mib": comm.total_mib,
                f"{n}_bytes": comm.payload_bytes, f"{n}_total_bytes": comm.total_bytes,
                f"{n}_elements": comm.elements, f"{n}_collectives": comm.collectives,
                f"{n}_time_us_estimate": comm.time_s * 1e6,
            })  # fmt: skip
    out["per_layer"] = per_layer
    out["per_step_total_mib"] = {
        n: (c.forward.total_bytes + c.backward.total_bytes) * report.dims.n_layers / MIB
        for n, c in report.strategies.items()
    }
    out["ratios_forward"] = ratios(report, "forward")
    out["ratios_backward"] = ratios(report, "backward")
    out["gemms"] = {
        n: [{**asdict(g), "intensity": g.intensity, "memory_bound": g.intensity < ridge}
            for g in c.gemms]
        for n, c in report.strategies.items()
    }  # fmt: skip
    out["layer_intensity"] = {n: c.intensity for n, c in report.strategies.items()}
    return out


def _comm_table(report: CostReport) -> Table:
    from ..costmodel import ratios

    d = report.dims
    t = Table(
        title=f"communication per layer: {d.name} (d={d.d}, d_ff={d.d_ff}, r={d.rank}, "
        f"H={d.n_heads}/{d.kv_heads}, L={d.n_layers}), tp={report.tp}, b={report.batch}, "
        f"s={report.seq}, {report.dtype}",
        title_justify="left",
        caption="MiB: all-reduce payload (tensor size, not ring traffic), 2**20 B, norm "
        "statistics excluded (BOOST's convention); stats: the fp32 norm statistics, fwd+bwd; "
        "#: collectives; ratio: fwd MiB over boost's. step: (fwd+bwd+stats) x L. est. us: fwd+bwd per layer, ring "
        f"alpha-beta ESTIMATE at {report.link.bandwidth_gbps:g} GB/s, "
        f"{report.link.latency_us:g} us (not measured).\n"
        + "\n".join(f"{n}: {c.title}" for n, c in report.strategies.items()),
        caption_justify="left",
    )
    cols = ("strategy", "fwd MiB", "#", "bwd MiB", "#", "stats", "ratio", "step MiB",
            "est. us")  # fmt: skip
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    rat = ratios(report)
    for n, c in report.strategies.items():
        f, bw = c.forward, c.backward
        stats = (f.stats_bytes + bw.stats_bytes) / 2**20
        t.add_row(
            n, f"{f.mib:,.2f}", str(f.collectives), f"{bw.mib:,.2f}", str(bw.collectives),
            f"{stats:.3g}", "1.00x" if n == "boost" else f"{rat[f'{n}/boost']:.2f}x",
            f"{(f.total_mib + bw.total_mib) * report.dims.n_layers:,.0f}",
            f"{(f.time_s + bw.time_s) * 1e6:,.0f}",
        )  # fmt: skip
    return t


def _fmt(g: Gemm, ridge: float) -> str:
    mark = " [red]mem-bound[/]" if g.intensity < ridge else ""
    return f"{g.K}x{g.N}  {g.intensity:,.0f}{mark}"


def _lowrank_gemm_table(report: CostReport, ridge: float) -> Table:
    m = report.batch * report.seq
    t = Table(
        title=f"low-rank factor GEMMs per rank: K x N and FLOP/byte (M = b*s = {m})",
        title_justify="left",
        caption="FLOP/B = 2MKN / (e(MK+KN+MN)) <= 2 min(M, K, N) / e: standard TP's r/p caps "
        f"it. mem-bound: below the ridge point {ridge:g} FLOP/B (--ridge). B = down factor, "
        "A = up factor.",
        caption_justify="left",
    )
    for c in ("factor", "standard TP", "BTP", "BOOST (grouped)"):
        t.add_column(c)
    std, btp = report.strategies["standard"].gemms, report.strategies["btp"].gemms
    boost = {g.name: g for g in report.strategies["boost"].gemms}
    group = {"q.B": "qkv.B", "k.B": "qkv.B", "v.B": "qkv.B", "gate.B": "gate_up.B",
             "up.B": "gate_up.B"}  # fmt: skip
    for gs, gb in zip(std, btp, strict=True):
        name = gs.name
        if name in boost:
            cell = _fmt(boost[name], ridge)
        elif name in ("q.B", "gate.B"):
            cell = f"{group[name]} {_fmt(boost[group[name]], ridge)}"
        else:
            cell = f"(in {group[name]})"
        t.add_row(name, _fmt(gs, ridge), _fmt(gb, ridge), cell)
    t.add_row(
        "layer (FLOP-weighted)",
        *(f"{report.strategies[n].intensity:,.0f}" for n in ("standard", "btp", "boost")),
    )
    return t


def _dense_gemm_table(report: CostReport, ridge: float) -> Table:
    t = Table(title="dense TP GEMMs per rank (Megatron)", title_justify="left")
    t.add_column("projection")
    t.add_column("K x N  FLOP/B")
    dense = report.strategies["dense"]
    for g in dense.gemms:
        t.add_row(g.name, _fmt(g, ridge))
    t.add_row("layer (FLOP-weighted)", f"{dense.intensity:,.0f}")
    return t


COST = Command(
    _cost_arguments,
    _cost_run,
    "Per-layer tensor-parallel communication (forward/backward payload MiB and collective "
    "counts) of dense TP, standard low-rank TP, BTP and BOOST; GEMM arithmetic intensity; "
    "an alpha-beta time estimate. Symbolic formulas: boost_compiler/costmodel/formulas.py.",
)
