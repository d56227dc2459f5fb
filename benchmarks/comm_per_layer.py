"""Tensor-parallel communication per layer: BOOST vs DTensor TP, measured with the profiler.

Runs ONE training step (forward + backward, after one warm-up step) of three tensor-parallel
set-ups on ``--tp`` CPU processes (gloo), at two depths (``n_layers`` 2 and 4), and counts the
collectives that actually hit the wire::

    python benchmarks/comm_per_layer.py                      # tp=2, d=256, d_ff=688, r=64
    python benchmarks/comm_per_layer.py --tp 2 --d 512 --ff 1376 --rank 128 --json out.json

Strategies
----------
``boost``
    ``boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})`` on the CoLA-LLaMA of
    ``boost_compiler.models.cola_llama`` (bottleneck-aware TP), then eager ``model(ids, labels=ids)``.
``dtensor-lowrank`` / ``dtensor-dense``
    torch DTensor TP in the plan torchtitan runs for LLaMA (``boost_compiler/bench/peers.py``):
    sequence-parallel norms and residual stream (all-gather before attention and the FFN,
    reduce-scatter after o and down), a vocabulary-parallel head under ``loss_parallel``.
    ``dtensor-lowrank`` is the "standard" low-rank plan of BOOST's paper (Megatron applied to
    each factor pair, split along r: ``.down`` colwise, ``.up`` rowwise) with that treatment;
    ``dtensor-dense`` the dense twin (every ``LowRankLinear`` an ``nn.Linear``).
``dtensor-lowrank-nosp`` / ``dtensor-dense-nosp``
    The same pairs without sequence parallelism or ``loss_parallel`` (embedding, norms and
    head replicated: no communication outside the layers), the previous baselines.

Each strategy's loss is checked against the single-device model's (column "loss err").

What is counted
---------------
Every profiler event whose name starts with ``gloo:`` during the profiled step on rank 0
(``torch.profiler``, CPU activity, ``record_shapes=True``; ``boost_compiler/bench/harness.py``, shared
with ``bench.py``). Those are the backend's own
events, one per collective that runs, whatever issued it (c10d, functional collectives,
DTensor redistribution, compiled graphs). Their ``input_shapes`` / ``input_dtypes`` record
the tensor(s) that the rank *contributes*:

- ``gloo:all_reduce``: the full tensor (a coalesced all-reduce lists several: summed). gloo
  implements ``reduce_scatter_tensor`` as an all-reduce of the full input, so it shows up
  here too, with the full size.
- ``gloo:all_gather``: only the local shard (the rank's input), NOT the gathered output.

"bytes" below are the *logical* collective size (the nccl-tests convention): all-reduce,
broadcast, reduce-scatter and all-to-all: the recorded input size; all-gather: the recorded
input size times the group size (= the gathered tensor). The JSON also holds the raw recorded
("contributed") bytes. Bytes per token per layer is the increment between the two depths:
``(bytes(L=4) - bytes(L=2)) / 2 / (batch * seq)``, forward + backward; collectives per layer
likewise. The forward/backward split classifies each event by its start time against the
start of ``loss.backward()``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the spawned workers import this script as benchmarks.comm_per_layer
    sys.path.insert(0, str(ROOT))

from boost_compiler.bench.harness import (  # noqa: E402
    BACKWARD_MARK,
    BOOST_DENSE,
    NOSP,
    STRATEGIES,
    ModelSpec,
    count_collectives,
    fmt_bytes,
    make_model,
    parallelize,
    scalar,
    spawn,
)

DEPTHS = (2, 4)


# --------------------------------------------------------------------------- measurement


def model_arguments(ap: argparse.ArgumentParser, vocab: int) -> None:
    """The model's sizes and the run's limits, shared by the per-layer benchmarks."""
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--ff", type=int, default=688)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=300, help="per collective (s); 2x per strategy")
    ap.add_argument("--json", default=None, help="also write the results to this file")


def model_spec(args: argparse.Namespace, n_layers: int) -> ModelSpec:
    return ModelSpec(
        d=args.d, ff=args.ff, rank=args.rank, layers=n_layers, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, batch=args.batch, seq=args.seq,
    )  # fmt: skip


def _make_model(strategy: str, n_layers: int, args: argparse.Namespace) -> nn.Module:
    return make_model(strategy, model_spec(args, n_layers))


def _measure(strategy: str, n_layers: int, args: argparse.Namespace, mesh: Any, world: int) -> dict:
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    from boost_compiler.models.cola_llama import example_inputs

    torch._dynamo.reset()
    model = _make_model(strategy, n_layers, args)
    (ids,) = example_inputs(model.cfg, batch=args.batch, seq=args.seq, seed=0)
    ref_loss = copy.deepcopy(model)(ids, labels=ids).item()

    t0 = time.perf_counter()
    parallelize(strategy, model, mesh, ids, world)
    t_par = time.perf_counter() - t0

    t0 = time.perf_counter()
    loss = model(ids, labels=ids)  # warm-up: fills caches
    loss.backward()
    model.zero_grad(set_to_none=True)
    t_warm = time.perf_counter() - t0
    dist.barrier()

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function("comm_per_layer::forward"):
            loss = model(ids, labels=ids)
        with record_function(BACKWARD_MARK):
            loss.backward()
    res = count_collectives(prof, world)
    loss_v = scalar(loss)
    res.update(
        n_layers=n_layers,
        loss=loss_v,
        ref_loss=ref_loss,
        loss_err=abs(loss_v - ref_loss) / max(abs(ref_loss), 1e-12),
        parallelize_s=t_par,
        warmup_s=t_warm,
    )
    return res


def measure_depths(
    *, rank: int, world: int, mesh: Any, strategy: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Spawned on every rank: one profiled eager step at each depth of :data:`DEPTHS`."""
    depths = {str(n): _measure(strategy, n, args, mesh, world) for n in DEPTHS}
    return {"strategy": strategy, "depths": depths}


def _run_strategy(strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    res = spawn(
        "benchmarks.comm_per_layer:measure_depths", args.tp,
        {"strategy": strategy, "args": args}, timeout_s=args.timeout * 2, tag=strategy,
    )  # fmt: skip
    res.setdefault("strategy", strategy)
    res.setdefault("depths", {})
    # The collectives must be the same on every rank; say so if not.
    counts = {
        r.get("rank"): [d.get("count") for d in r.get("depths", {}).values()]
        for r in res.get("per_rank", [])
        if "error" not in r
    }
    res["ranks_agree"] = len({tuple(c) for c in counts.values()}) <= 1
    res.pop("per_rank", None)
    return res


# --------------------------------------------------------------------------- report


def _analytic(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Expected elements per token per layer (forward, backward)."""
    d, ff, r = args.d, args.ff, args.rank
    kv = (args.kv_heads or args.heads) * (d // args.heads)
    return {
        # 7 latents all-reduced (q,k,v,o,gate,up,down), + one norm statistic per RMSNorm when
        # fused into the following all-reduce; backward: the same 7 latents' input grads.
        "boost": {"fwd": 7 * r + 2, "bwd": 7 * r},
        # BTP alone: 7 separate latent all-reduces + 2 standalone statistics, both ways.
        "boost-btp": {"fwd": 7 * r + 2, "bwd": 7 * r + 2},
        # outputs of every up factor: q (d) + k, v (kv) + o (d) + gate, up (ff) + down (d);
        # backward: input grads of every down factor: q,k,v,gate,up (d) + o (d) + down (ff).
        "dtensor-lowrank-nosp": {"fwd": d + 2 * kv + d + 2 * ff + d, "bwd": 6 * d + ff},
        # Megatron: o and down outputs; backward: q,k,v and gate,up input grads, which DTensor
        # all-reduces per module (5d) where Megatron's f would all-reduce once per block (2d).
        "dtensor-dense-nosp": {"fwd": 2 * d, "bwd": 5 * d},
        # torchtitan (sequence parallel): all-gather d before attention and the FFN,
        # reduce-scatter d after o and down, each mirrored in the backward (bench/peers.py);
        # low-rank adds the up factors' all-reduces of q, k, v, gate, up forward and the
        # o.down / down.down input gradients backward (q/k/v, gate/up sum in the gathers' RS).
        "dtensor-lowrank": {"fwd": 5 * d + 2 * kv + 2 * ff, "bwd": 5 * d + ff},
        "dtensor-dense": {"fwd": 4 * d, "bwd": 4 * d},
    }


def _per_layer(res: dict[str, Any], key: str, tokens: int) -> float | None:
    deps = res.get("depths", {})
    if not all(str(n) in deps for n in DEPTHS):
        return None
    lo, hi = deps[str(DEPTHS[0])], deps[str(DEPTHS[1])]

    def get(d: dict[str, Any]) -> float:
        v: Any = d
        for k in key.split("."):
            v = v[k]
        return float(v)

    return (get(hi) - get(lo)) / (DEPTHS[1] - DEPTHS[0]) / tokens


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    tokens = args.batch * args.seq
    analytic = _analytic(args)
    summary: dict[str, Any] = {"config": vars(args).copy(), "strategies": {}}
    for s, res in results.items():
        per = {
            "bytes_per_token_layer": _per_layer(res, "bytes", tokens),
            "fwd_bytes_per_token_layer": _per_layer(res, "fwd.bytes", tokens),
            "bwd_bytes_per_token_layer": _per_layer(res, "bwd.bytes", tokens),
            "collectives_per_layer": _per_layer(res, "count", 1),
            "fwd_collectives_per_layer": _per_layer(res, "fwd.count", 1),
            "bwd_collectives_per_layer": _per_layer(res, "bwd.count", 1),
        }
        # boost-dense (the planner on the dense twin) has no closed form: its bound is the
        # torchtitan plan of the same twin.
        a = analytic[s if s in analytic else "dtensor-dense"]
        per["analytic_bytes_per_token_layer"] = {
            "fwd": a["fwd"] * 4,
            "bwd": a["bwd"] * 4,
            "total": (a["fwd"] + a["bwd"]) * 4,
        }
        summary["strategies"][s] = {**res, **per}

    boost = summary["strategies"].get("boost", {})
    boost_b, boost_fb = boost.get("bytes_per_token_layer"), boost.get("fwd_bytes_per_token_layer")
    table = Table(
        title=(
            f"Tensor-parallel communication, tp={args.tp}, d={args.d}, d_ff={args.ff}, "
            f"r={args.rank}, heads={args.heads}/{args.kv_heads or args.heads}, batch={args.batch}, seq={args.seq}, fp32; "
            "one fwd+bwd step, rank 0, gloo events"
        )
    )
    cols = [
        "strategy",
        "coll/step L=2",
        "coll/step L=4",
        "coll/layer (fwd+bwd)",
        "bytes/step L=2",
        "bytes/step L=4",
        "B/token/layer (fwd+bwd)",
        "analytic B/tok/layer (fwd+bwd)",
        "ratio vs boost (fwd)",
        "loss err",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "strategy" else "right")
    for s, res in summary["strategies"].items():
        deps = res.get("depths", {})
        lo, hi = deps.get(str(DEPTHS[0]), {}), deps.get(str(DEPTHS[1]), {})
        b, fb, bb = (
            res["bytes_per_token_layer"],
            res["fwd_bytes_per_token_layer"],
            res["bwd_bytes_per_token_layer"],
        )
        c, fc, bc = (
            res["collectives_per_layer"],
            res["fwd_collectives_per_layer"],
            res["bwd_collectives_per_layer"],
        )
        an = res["analytic_bytes_per_token_layer"]
        errs = [v["loss_err"] for v in deps.values()]
        table.add_row(
            s + (" [red](FAILED)[/red]" if "error" in res else ""),
            str(lo.get("count", "-")),
            str(hi.get("count", "-")),
            "-" if c is None else f"{c:g} ({fc:g}+{bc:g})",
            fmt_bytes(lo["bytes"]) if lo else "-",
            fmt_bytes(hi["bytes"]) if hi else "-",
            "-" if b is None else f"{b:.0f} ({fb:.0f}+{bb:.0f})",
            f"{an['total']:.0f} ({an['fwd']:.0f}+{an['bwd']:.0f})",
            "-" if b is None or not boost_b else f"{b / boost_b:.2f}x ({fb / boost_fb:.2f}x)",
            "-" if not errs else f"{max(errs):.1e}",
        )
    console.print(table)
    d, ff, r = args.d, args.ff, args.rank
    console.print(
        "Analytic elements/token/layer (x4 bytes in fp32): "
        f"boost fwd 7r (+2 norm statistics) = {7 * r}(+2), bwd 7r = {7 * r}; "
        f"torchtitan plans: low-rank fwd 5d+2kv+2ff = {analytic['dtensor-lowrank']['fwd']}, "
        f"bwd 5d+ff = {5 * d + ff}; dense 4d = {4 * d} each way. Without SP (-nosp): "
        f"low-rank fwd 3d+d+2ff+d (MHA) = {analytic['dtensor-lowrank-nosp']['fwd']}, "
        f"bwd 6d+ff = {6 * d + ff}; dense fwd 2d = {2 * d}, bwd 5d (DTensor, per-module "
        f"q,k,v,gate,up input-grad all-reduces) = {5 * d}."
    )
    for s, res in summary["strategies"].items():
        if "error" in res:
            console.print(f"[red]{s} failed[/red] (rank {res.get('failed_rank')}): {res['error']}")
            tail = "\n".join(res.get("traceback", "").strip().splitlines()[-25:])
            if tail:
                console.print(tail, markup=False, highlight=False)
        elif not res.get("ranks_agree", True):
            console.print(f"[yellow]{s}: ranks issued different numbers of collectives[/yellow]")
    if args.verbose:
        for s, res in summary["strategies"].items():
            for n, dep in res.get("depths", {}).items():
                console.print(f"{s} L={n}: gloo events (phase, op, recorded input shapes, dtype)")
                for k, v in dep["shapes"].items():
                    console.print(f"   {v:4d} x {k}", markup=False, highlight=False)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    model_arguments(ap, vocab=256)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every gloo event shape")
    args = ap.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    known = (*STRATEGIES, *NOSP, BOOST_DENSE)
    for s in strategies:
        if s not in known:
            ap.error(f"unknown strategy {s!r}; choose from {known}")

    results: dict[str, dict[str, Any]] = {}
    for s in strategies:
        results[s] = _run_strategy(s, args)
        print(
            f"[{s}] done in {results[s]['wall_s']:.1f} s"
            + (f" -- ERROR: {results[s]['error']}" if "error" in results[s] else ""),
            flush=True,
        )
    summary = _report(results, args)
    line = json.dumps(summary, default=str)
    print(
        "JSON "
        + json.dumps(
            {
                s: {
                    k: v
                    for k, v in r.items()
                    if k.endswith("per_layer") or k.endswith("token_layer")
                }
                for s, r in summary["strategies"].items()
            }
        )
    )
    if args.json:
        Path(args.json).write_text(line + "\n")
    return summary


if __name__ == "__main__":
    main()
