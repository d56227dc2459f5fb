"""Hybrid model (low-rank CoLA attention + DENSE SwiGLU MLP): TP communication per token per layer.

BOOST's plan today against a Megatron sequence-parallel (torchtitan) plan, on a CoLA-LLaMA whose
attention stays low-rank (``LowRankLinear`` q/k/v/o) and whose MLP is dense (gate/up/down are
``nn.Linear`` of the same in/out features). One training step (forward + backward, eager,
after one warm-up step) on ``--tp`` CPU processes (gloo), at two depths (``n_layers`` 2 and
4)::

    python benchmarks/hybrid_mlp.py                       # tp=2, d=256, d_ff=688, r=64, 4 heads
    python benchmarks/hybrid_mlp.py --tp 2 --d 512 --ff 1376 --rank 128 --json out.json

Strategies
----------
``boost``
    ``boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})`` on the hybrid, then
    ``model(ids, labels=ids)``: today's plan, whatever it does with a dense MLP.
``dtensor-sp``
    torch DTensor TP in torchtitan's LLaMA layout (``boost_compiler/bench/peers.py``):
    vocabulary-parallel embedding and head, ``SequenceParallel`` norms, block inputs gathered
    by ``PrepareModuleInput``; in the attention the "standard" low-rank plan of
    ``peers.block_plan(lowrank=True)`` (``.down`` colwise, ``.up`` rowwise, o's up factor
    reduce-scattering into the sequence-sharded residual); in the MLP the dense Megatron-SP
    plan of ``peers.block_plan(lowrank=False)`` (gate/up ``ColwiseParallel``, down
    ``RowwiseParallel(output_layouts=Shard(1))``: the intermediate [b, s, f] stays sharded,
    one all-gather in and one reduce-scatter out of [b, s, d]). The loss runs under
    ``loss_parallel()`` (forward and backward).

The model is ``boost_compiler.models.cola_llama.build("tiny", ...)`` with the sizes given,
the MLP projections of every layer replaced as ``boost_compiler/bench/harness.py``'s
``make_model`` makes the dense twin (``nn.Linear(d_in, d_out, bias=False)``, seeded), but
for ``.mlp`` only. Each strategy's loss is compared with the single-device model's
("loss err", relative).

What is counted (as ``benchmarks/comm_per_layer.py``, whose helpers this reuses): every
``gloo:*`` profiler event on rank 0 during the profiled step. "bytes" is the logical
collective size (nccl-tests' convention, ``harness.count_collectives``): the tensor size the
profiler records as the event's input for all-reduce (gloo runs ``reduce_scatter_tensor`` as
an all-reduce of the full input, so a reduce-scatter counts its full [b, s, d] input), and
that recorded input (the rank's shard) times the group size for all-gather (= the gathered
tensor). "contrib" is the raw recorded input size (what the rank contributes). Per token per
layer is ``(value(L=4) - value(L=2)) / 2 / (batch * seq)``, which cancels the embedding, head
and loss; forward / backward split at the start of ``loss.backward()``.

Also printed: the collectives of BOOST's plan (``model.boost_plan.collectives``: kind,
global shape, dtype, forward / backward, reason, bytes) that belong to layer 0's MLP, and the
placements it gave the MLP's weights, so one sees what the plan does with the dense
intermediate [b, s, f].
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the spawned workers import this script as benchmarks.hybrid_mlp
    sys.path.insert(0, str(ROOT))

from benchmarks.comm_per_layer import DEPTHS, _per_layer, model_arguments, model_spec  # noqa: E402
from boost_compiler.bench.harness import (  # noqa: E402
    BACKWARD_MARK,
    ModelSpec,
    count_collectives,
    make_model,
    scalar,
    spawn,
)
from boost_compiler.bench.harness import parallelize as harness_parallelize  # noqa: E402
from boost_compiler.bench.peers import (  # noqa: E402
    PROJS,
    _keep_labels_call,
    block_plan,
    top_plan,
)
from boost_compiler.models.cola_llama import next_token_loss  # noqa: E402

STRATEGIES = ("boost", "dtensor-sp")


# --------------------------------------------------------------------------- model and plans


def make_hybrid(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The low-rank CoLA-LLaMA of ``spec`` with every layer's MLP projections dense."""
    from boost_compiler.models.cola_llama import LowRankLinear

    model = make_model("boost", spec, seed=seed)  # the low-rank model, untied
    torch.manual_seed(seed + 1)  # as harness.make_model's dense twin
    for block in model.layers:
        for name in PROJS["mlp"]:
            lr = getattr(block.mlp, name)
            assert isinstance(lr, LowRankLinear)
            setattr(block.mlp, name, nn.Linear(lr.down.in_features, lr.up.out_features, bias=False))
    return model


def hybrid_block_plan() -> dict[str, Any]:
    """torchtitan's block layout: low-rank factor plan for attention, dense plan for the MLP."""
    plan = {k: v for k, v in block_plan(lowrank=True).items() if not k.startswith("mlp.")}
    plan.update({k: v for k, v in block_plan(lowrank=False).items() if k.startswith("mlp.")})
    return plan


def apply_hybrid_tp(model: nn.Module, mesh: Any) -> None:
    """Shard ``model`` in place (attention keeps all heads on every rank, as peers' low-rank)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, top_plan())
    for block in model.layers:
        parallelize_module(block, mesh, hybrid_block_plan())
    _keep_labels_call(model)  # model(ids) -> vocabulary-sharded logits (a DTensor)


def _step_loss(strategy: str, model: nn.Module, ids: torch.Tensor, backward_mark: str | None):
    """One forward + backward; the loss. ``backward_mark``: a profiler range around backward."""
    import contextlib

    from torch.profiler import record_function

    if strategy == "dtensor-sp":
        from torch.distributed.tensor.parallel import loss_parallel

        ctx: contextlib.AbstractContextManager[Any] = loss_parallel()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        with record_function("hybrid_mlp::forward"):
            if strategy == "dtensor-sp":
                loss = next_token_loss(model(ids), ids)
            else:
                loss = model(ids, labels=ids)
        with record_function(backward_mark) if backward_mark else contextlib.nullcontext():
            loss.backward()
    return loss


# --------------------------------------------------------------------------- measurement

_LAYER0_MLP = ("layers.0.mlp_norm", "layers.0.mlp")  # the MLP sub-block of layer 0


def _node_modules(graph: Any, param_names: dict[str, str]) -> dict[str, str]:
    """Each node's module path (``layers.0.mlp.down_proj``): its ``nn_module_stack``, a
    parameter's owner, or, for a node a pass inserted, the latest module among its inputs
    (``boost_compiler/explain/node_style.py``'s ``assign_groups``, at module instead of layer grain)."""
    from boost_compiler.explain.draw import stack_path

    out: dict[Any, str] = {}
    order: dict[str, int] = {"": -1}
    for node in graph.nodes:
        if node.op == "placeholder":
            path = param_names.get(node.name, "").rpartition(".")[0]
        elif stack := node.meta.get("nn_module_stack") or {}:
            entry = list(stack.values())[-1]
            path = stack_path(str(entry[0] if isinstance(entry, (tuple, list)) else entry))
        else:
            paths = [out[a] for a in node.all_input_nodes if out.get(a)]
            path = max(paths, key=order.__getitem__) if paths else ""
        out[node] = path
        order.setdefault(path, len(order))
    return {n.name: p for n, p in out.items()}


def plan_by_module(args: argparse.Namespace, n_layers: int = DEPTHS[0]) -> list[dict[str, Any]]:
    """BOOST's collectives for the hybrid, each with the module it sits in.

    ``parallelize``'s own planning (capture, the pass pipeline with ``TP_REQUIRED``, as
    ``boost_compiler/parallel/parallelize.py``'s ``_plan``) on a simulated ``--tp`` group in this
    process (as ``boost explain``), since the plan names only the nodes.
    """
    from boost_compiler.explain.run import simulated_group
    from boost_compiler.ir.capture import capture
    from boost_compiler.models.cola_llama import example_inputs
    from boost_compiler.options import BoostOptions
    from boost_compiler.passes import TP_REQUIRED, PassContext
    from boost_compiler.passes.driver import run_pipeline
    from boost_compiler.tp.collectives import graph_collectives
    from boost_compiler.tp.plan import TPPlan

    model = make_hybrid(model_spec(args, n_layers))
    (ids,) = example_inputs(model.cfg, batch=args.batch, seq=args.seq, seed=0)
    graphs = capture(model, (ids,), {"labels": ids})
    rows: list[dict[str, Any]] = []
    with simulated_group(args.tp) as group:
        plan = TPPlan(p=group.size, group=group.name)
        for g in graphs:
            ctx = PassContext(g.param_names, tp=group, fixed=dict(plan.params))
            run_pipeline(g.gm, ctx, BoostOptions.parse(None), required=TP_REQUIRED)
            collectives = graph_collectives(g.gm.graph)
            plan.add_graph("parallelize", (), ctx.notes["btp"], ctx.bottlenecks, collectives)
            where = _node_modules(g.gm.graph, g.param_names)
            rows += [{"module": where.get(c.node, ""), **_collective(c)} for c in collectives]
    return rows


def _collective(c: Any) -> dict[str, Any]:
    return {
        "kind": c.kind, "node": c.node, "global_shape": [int(s) for s in c.global_shape],
        "dtype": str(c.dtype).removeprefix("torch."), "forward": bool(c.forward),
        "backward": bool(c.backward), "reason": c.reason, "nbytes": int(c.nbytes),
    }  # fmt: skip


def _plan_info(model: nn.Module) -> dict[str, Any]:
    """BOOST's plan: every collective (JSON-able), the MLP weights' placements, fallbacks."""
    plan = model.boost_plan
    colls = [_collective(c) for c in plan.collectives]
    placements = {n: str(p) for n, p in plan.params.items() if n.startswith(_LAYER0_MLP)}
    bottlenecks = [f"{b.down} -> {b.up} ({b.d_in}->{b.rank}->{b.d_out})" for b in plan.bottlenecks]
    return {
        "collectives": colls,
        "mlp_placements": placements,
        "bottlenecks": bottlenecks,
        "fallbacks": list(plan.fallbacks),
        "decisions": list(plan.decisions),
        # what the planner predicted for the graph that ran (its last compile), before rewriting
        "predicted_bytes": plan.graphs[-1].predicted_bytes,
    }


def _measure(strategy: str, n_layers: int, args: argparse.Namespace, mesh: Any, world: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from boost_compiler.models.cola_llama import example_inputs

    torch._dynamo.reset()
    model = make_hybrid(model_spec(args, n_layers))
    (ids,) = example_inputs(model.cfg, batch=args.batch, seq=args.seq, seed=0)
    ref_loss = copy.deepcopy(model)(ids, labels=ids).item()

    if strategy == "boost":
        harness_parallelize("boost", model, mesh, ids, world)
    else:
        apply_hybrid_tp(model, mesh)

    _step_loss(strategy, model, ids, None)  # warm-up: fills caches
    model.zero_grad(set_to_none=True)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = _step_loss(strategy, model, ids, BACKWARD_MARK)
    res = count_collectives(prof, world)
    for phase in ("fwd", "bwd"):  # raw recorded (contributed) bytes by phase, too
        res[phase]["contributed_bytes"] = sum(
            _contributed(k, v) for k, v in res["shapes"].items() if k.startswith(phase + " ")
        )
    loss_v = scalar(loss)
    res.update(
        n_layers=n_layers,
        loss=loss_v,
        ref_loss=ref_loss,
        loss_err=abs(loss_v - ref_loss) / max(abs(ref_loss), 1e-12),
    )
    if strategy == "boost":
        res["plan"] = _plan_info(model)
    return res


def _contributed(key: str, n: int) -> int:
    """Recorded input bytes of ``n`` events of one ``count_collectives`` shape key."""
    from boost_compiler.bench.harness import elem_bytes

    _phase, _op, rest = key.split(" ", 2)
    end = rest.rfind("]") + 1  # shapes "[..]+[..]", then dtypes ("long int" has a space)
    shapes, dts = rest[:end], rest[end:].strip().split(",")
    total = 0
    for i, s in enumerate(re.findall(r"\[([^\]]*)\]", shapes)):
        if s.strip():
            numel = 1
            for x in s.split(","):
                numel *= int(x)
            total += numel * elem_bytes(dts[i] if i < len(dts) else "float")
    return total * n


def measure_depths(
    *, rank: int, world: int, mesh: Any, strategy: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Spawned on every rank: one profiled eager step at each depth of ``DEPTHS``."""
    return {
        "strategy": strategy,
        "depths": {str(n): _measure(strategy, n, args, mesh, world) for n in DEPTHS},
    }


# --------------------------------------------------------------------------- report


def _analytic(args: argparse.Namespace) -> dict[str, tuple[int, int, int, int]]:
    """Expected (fwd collectives, fwd elements/token, bwd collectives, bwd elements/token)."""
    d = args.d
    kv = (args.kv_heads or args.heads) * (d // args.heads)
    # dtensor-sp: attention as peers.predict's low-rank (AG d, AR q d + k,v kv, RS o.up d;
    # backward RS d, AG d, AR o.down input grad d); MLP as its dense (AG d + RS d each way).
    return {"dtensor-sp": (3 + 2 + 2, 3 * d + 2 * kv + 2 * d, 3 + 2, 3 * d + 2 * d)}


def _plan_bytes(deps: dict[str, Any], n: int, way: str) -> int:
    """Bytes of the plan's collectives at depth ``n`` that communicate ``way`` ("forward"...)."""
    return sum(c["nbytes"] for c in deps[str(n)]["plan"]["collectives"] if c[way])


def _num(per: dict[str, Any], key: str, fmt: str = ".0f") -> str:
    v = per.get(key)
    return "-" if v is None else format(v, fmt)


def _report(
    results: dict[str, dict[str, Any]], by_module: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    tokens = args.batch * args.seq
    summary: dict[str, Any] = {"config": vars(args).copy(), "strategies": {}}
    table = Table(
        title=(
            f"Hybrid (low-rank attention + dense SwiGLU MLP) TP communication per token per layer, "
            f"tp={args.tp}, d={args.d}, d_ff={args.ff}, r={args.rank}, heads={args.heads}, "
            f"vocab={args.vocab}, batch={args.batch}, seq={args.seq}, fp32; one eager fwd+bwd "
            "step, rank 0, gloo events, (L=4 - L=2)/2"
        )
    )
    for c in ("strategy", "fwd coll", "bwd coll", "fwd B/tok/layer", "bwd B/tok/layer",
              "total B/tok/layer", "contrib B/tok/layer (fwd+bwd)", "expected (fwd+bwd)",
              "boost plan B/tok/layer (fwd+bwd)", "planner predicted B/tok/layer",
              "loss err"):  # fmt: skip
        table.add_column(c, justify="left" if c == "strategy" else "right")
    analytic = _analytic(args)
    for s, res in results.items():
        per = {
            key: _per_layer(res, path, 1 if "count" in path else tokens)
            for key, path in (
                ("fwd_collectives_per_layer", "fwd.count"),
                ("bwd_collectives_per_layer", "bwd.count"),
                ("fwd_bytes_per_token_layer", "fwd.bytes"),
                ("bwd_bytes_per_token_layer", "bwd.bytes"),
                ("bytes_per_token_layer", "bytes"),
                ("fwd_contributed_bytes_per_token_layer", "fwd.contributed_bytes"),
                ("bwd_contributed_bytes_per_token_layer", "bwd.contributed_bytes"),
            )
        }
        deps = res.get("depths", {})
        plan_col = predicted_col = "-"
        if s == "boost" and all(str(n) in deps and "plan" in deps[str(n)] for n in DEPTHS):
            pred = [deps[str(n)]["plan"]["predicted_bytes"] for n in DEPTHS]
            per["predicted_bytes_per_token_layer"] = (
                (pred[1] - pred[0]) / (DEPTHS[1] - DEPTHS[0]) / tokens
            )
            predicted_col = f"{per['predicted_bytes_per_token_layer']:.0f}"
            pf, pb = (
                (_plan_bytes(deps, DEPTHS[1], w) - _plan_bytes(deps, DEPTHS[0], w))
                / (DEPTHS[1] - DEPTHS[0])
                / tokens
                for w in ("forward", "backward")
            )
            per["plan_fwd_bytes_per_token_layer"], per["plan_bwd_bytes_per_token_layer"] = pf, pb
            plan_col = f"{pf + pb:.0f} ({pf:.0f}+{pb:.0f})"
        errs = [v["loss_err"] for v in deps.values()]
        per["loss_err"] = max(errs) if errs else None
        summary["strategies"][s] = {**res, **per}
        exp = "-"
        if s in analytic:
            fc, fe, bc, be = analytic[s]
            exp = f"{4 * (fe + be)} ({4 * fe}+{4 * be}), {fc}+{bc} coll"
        ok = all(per[k] is not None for k in per if k.endswith("_layer"))

        table.add_row(
            s + (" [red](FAILED)[/red]" if "error" in res else ""),
            _num(per, "fwd_collectives_per_layer", "g"),
            _num(per, "bwd_collectives_per_layer", "g"),
            _num(per, "fwd_bytes_per_token_layer"),
            _num(per, "bwd_bytes_per_token_layer"),
            _num(per, "bytes_per_token_layer"),
            "-"
            if not ok
            else f"{per['fwd_contributed_bytes_per_token_layer'] + per['bwd_contributed_bytes_per_token_layer']:.0f}"
            f" ({per['fwd_contributed_bytes_per_token_layer']:.0f}"
            f"+{per['bwd_contributed_bytes_per_token_layer']:.0f})",
            exp,
            plan_col,
            predicted_col,
            "-" if per["loss_err"] is None else f"{per['loss_err']:.1e}",
        )
    console.print(table)

    boost = results.get("boost", {}).get("depths", {}).get(str(DEPTHS[0]), {})
    plan = boost.get("plan")
    if by_module:
        key = [(c["kind"], c["node"], tuple(c["global_shape"])) for c in by_module]
        real = [
            (c["kind"], c["node"], tuple(c["global_shape"]))
            for c in (plan or {}).get("collectives", [])
        ]
        same = "the same" if key == real else "[red]NOT the same[/red]"
        console.print(
            f"\nBOOST plan today (L={DEPTHS[0]}): collectives of layer 0's MLP (mlp_norm + mlp; "
            f"module of each node from the planning rerun in this process, {same} "
            f"collectives as the workers' model.boost_plan)"
        )
        t = Table()
        for c in ("module", "kind", "node", "global shape", "dtype", "fwd", "bwd", "bytes",
                  "B/token", "reason"):  # fmt: skip
            t.add_column(c)
        mlp = [c for c in by_module if c["module"].startswith(_LAYER0_MLP)]
        for c in mlp:
            t.add_row(
                c["module"], c["kind"], c["node"], str(c["global_shape"]), c["dtype"],
                str(c["forward"]), str(c["backward"]), str(c["nbytes"]),
                f"{c['nbytes'] / tokens:g}", c["reason"],
            )  # fmt: skip
        console.print(t)
        for way in ("forward", "backward"):
            n = sum(c[way] for c in mlp)
            b = sum(c["nbytes"] for c in mlp if c[way]) / tokens
            console.print(f"layer 0 MLP, {way}: {n} collectives, {b:g} B/token")
        if args.verbose:
            console.print(f"every collective of the plan (L={DEPTHS[0]}), by module:")
            for c in by_module:
                console.print("  ", c, markup=False, highlight=False)
    if plan:
        console.print("layer 0 MLP weight placements:", plan["mlp_placements"])
        console.print(f"bottlenecks found: {len(plan['bottlenecks'])}")
        for b in plan["bottlenecks"]:
            console.print("  " + b, markup=False, highlight=False)
        for what in ("fallbacks", "decisions"):
            if plan[what]:
                console.print(f"{what}:")
                for line in plan[what]:
                    console.print("  " + line, markup=False, highlight=False)
    for s, res in results.items():
        if "error" in res:
            console.print(f"[red]{s} failed[/red] (rank {res.get('failed_rank')}): {res['error']}")
            tail = "\n".join(res.get("traceback", "").strip().splitlines()[-25:])
            if tail:
                console.print(tail, markup=False, highlight=False)
        elif not res.get("ranks_agree", True):
            console.print(f"[yellow]{s}: ranks issued different numbers of collectives[/yellow]")
        if args.verbose:
            for n, dep in res.get("depths", {}).items():
                console.print(f"{s} L={n}: gloo events (phase, op, recorded input shapes, dtype)")
                for k, v in dep.get("shapes", {}).items():
                    console.print(f"   {v:4d} x {k}", markup=False, highlight=False)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    model_arguments(ap, vocab=512)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    ap.add_argument("-v", "--verbose", action="store_true", help="every gloo event and collective")
    args = ap.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; choose from {STRATEGIES}")

    results: dict[str, dict[str, Any]] = {}
    for s in strategies:
        res = spawn(
            "benchmarks.hybrid_mlp:measure_depths", args.tp,
            {"strategy": s, "args": args}, timeout_s=args.timeout * 2, tag=s,
        )  # fmt: skip
        res.setdefault("depths", {})
        counts = {
            r.get("rank"): tuple(d.get("count") for d in r.get("depths", {}).values())
            for r in res.get("per_rank", [])
            if "error" not in r
        }
        res["ranks_agree"] = len(set(counts.values())) <= 1
        res.pop("per_rank", None)
        results[s] = res
        print(
            f"[{s}] done in {res['wall_s']:.1f} s"
            + (f" -- ERROR: {res['error']}" if "error" in res else ""),
            flush=True,
        )
    by_module: list[dict[str, Any]] = []
    if "boost" in strategies:
        try:
            by_module = plan_by_module(args)
        except Exception as exc:  # noqa: BLE001 - the measurements stand without it
            print(f"planning rerun for the module table failed: {type(exc).__name__}: {exc}")
    summary = _report(results, by_module, args)
    summary["boost_plan_by_module"] = by_module
    if args.json:
        Path(args.json).write_text(json.dumps(summary, default=str) + "\n")
    return summary


if __name__ == "__main__":
    main()
