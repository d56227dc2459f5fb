"""The sizes of ``boost bench`` and what it computes from the raw per-rank results.

:func:`analyse` turns the spawned groups' results (:func:`split_group`) into one row per
size and system: step statistics, tokens/s, the ratios to BOOST, the parallel efficiency
``T(1 process, Inductor) / (p x T(system))``, the loss check against eager, per-rank
memory (the largest rank's), and the measured communication against :func:`predict`.
"""

from __future__ import annotations

import statistics
from typing import Any

from . import peers
from .breakdown import summarise
from .harness import DENSE, ModelSpec
from .training import BOOST_VARIANTS, TP_SYSTEMS

SIZES: dict[str, ModelSpec] = {
    # a smoke-test size (the "tiny" preset of boost_compiler.models.cola_llama)
    "tiny": ModelSpec(d=64, ff=172, rank=16, layers=2, heads=4, batch=2, seq=32),
    # the reference decoder of the README's measurements
    "small": ModelSpec(d=256, ff=688, rank=64, layers=2, heads=4, batch=2, seq=64),
    # the CoLA "60m" width at 4 layers
    "large": ModelSpec(d=512, ff=1376, rank=128, layers=4, heads=8, batch=4, seq=256),
    # the same with the vocabulary of LLaMA-2 and of the paper's models: the embedding and
    # head (2 x 16.4M parameters) outweigh the 4 low-rank blocks (5.0M)
    "large-v32k": ModelSpec(
        d=512, ff=1376, rank=128, layers=4, heads=8, vocab=32000, batch=4, seq=256
    ),
    # LLaMA-3's vocabulary: [4, 256, 128256] fp32 logits are 525 MB per copy (not a default)
    "large-v128k": ModelSpec(
        d=512, ff=1376, rank=128, layers=4, heads=8, vocab=128256, batch=4, seq=256
    ),
}
DEFAULT_SIZES = ("small", "large", "large-v32k")
LABELS = {
    "boost": "BOOST (boost_compiler, tp)",
    "dtensor-lowrank": "DTensor TP, standard low-rank plan, torchtitan's SP + loss_parallel",
    "dtensor-dense": "DTensor TP, dense model, torchtitan's LLaMA plan",
    "dtensor-lowrank-nosp": "DTensor TP, standard low-rank plan, blocks only",
    "dtensor-dense-nosp": "DTensor TP, dense model, Megatron in the blocks only",
    "inductor": "1 process, backend='inductor'",
    "eager": "1 process, eager",
}
COST_KEY = {"dtensor-lowrank-nosp": "standard", "dtensor-dense-nosp": "dense"}


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

    if system in peers.TORCHTITAN:
        return peers.predict(system, spec, tp)
    if system in BOOST_VARIANTS:  # the same collectives, waited for differently
        system = "boost"

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
    head = "vocab-parallel head (all-gather [b,s,d] fwd, reduce-scatter bwd) + loss and norm stats"
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
    ranks = [pr.get("sizes", {}).get(size, {}).get("breakdown") for pr in res.get("per_rank", [])]
    if ranks and all(ranks):
        row["breakdown"] = summarise(ranks)
    row["threads"] = r.get("threads")
    row["world"] = r.get("world")
    row["marks_us"] = r.get("profile", {}).get("marks_us", {})
    row["memory"] = _worst_rank(r.get("memory_ranks") or [r.get("memory") or {}])
    row["rss_hwm_bytes"] = r.get("rss_hwm_bytes")
    return row


def _worst_rank(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each memory figure's largest value over the ranks (a rank holding more is the limit)."""
    keys = {k for m in ranks for k in m}
    out: dict[str, Any] = {}
    for k in sorted(keys):
        vals = [m[k] for m in ranks if m.get(k) is not None]
        out[k] = max(vals) if vals else None
    return out


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
    """Each row's loss distance to 1-process eager, its step time over BOOST's, and its
    parallel efficiency ``T(1 process, Inductor) / (processes x T(system))``."""
    eager = rows.get("eager", {}).get("losses")
    boost = rows.get("boost", {})
    single = rows.get("inductor", {}).get("step_s")
    for system, row in rows.items():
        if "error" in row:
            continue
        if single is not None:
            row["efficiency"] = single / ((row.get("world") or 1) * row["step_s"])
        one = rows.get("inductor", {}).get("breakdown")
        if one and "breakdown" in row:  # the busiest rank's GEMM time over one process's
            row["gemm_vs_single"] = row["breakdown"]["max"]["GEMM"] / one["max"]["GEMM"]
        if eager and system not in DENSE:
            n = min(len(eager), len(row["losses"]))
            row["loss_vs_eager"] = max(
                abs(a - b) / max(abs(b), 1e-12)
                for a, b in zip(row["losses"][:n], eager[:n], strict=True)
            )
        if "step_s" in boost:
            row["boost_speedup"] = row["step_s"] / boost["step_s"]
            row["boost_speedup_fwd_bwd"] = row["fwd_bwd_s"] / boost["fwd_bwd_s"]
