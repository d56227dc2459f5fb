"""Multi-process harness: one gloo group per test module, results back as JSON.

``run_world(world, checks, slow)`` spawns ``world`` CPU processes once; each runs
every named check (functions of this module taking ``(rank, world, mesh)``, or
``"package.module:function"``) and every rank returns its own results: the test
gets every key combined over all ranks (:func:`across_ranks`: the worst rank's
error, values that must agree on every rank), all ranks' dicts under ``"ranks"``
(:func:`ranks`), failures from any rank as ``"error"``. Checks whose key is in
``slow`` run only with ``BOOST_FULL_TESTS=1``; :func:`result_of` skips those and
fails on a key the harness does not know.

What "exact against one device" means here (:func:`compare_training`): every
step, the forward output element by element, the loss (for logits: cross-entropy
against fixed random targets, which no sign flip or permutation leaves alone),
every gathered gradient; after the last optimizer step every gathered parameter;
and replicated parameters and gradients bit-identical across the ranks.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

RTOL = 1e-5
# The costly compiled variants run only with BOOST_FULL_TESTS=1 (see docs/setup.md).
FULL_TESTS = os.environ.get("BOOST_FULL_TESTS") == "1"
SLOW_REASON = "a costly compiled variant; BOOST_FULL_TESTS=1 runs it"


def result_of(results: dict[str, Any], key: str) -> dict[str, Any]:
    """A check's result (every key combined over the ranks, each rank's under ``"ranks"``), error-free.

    A key that ``run_world`` was not given fails (a renamed check must not stop
    running silently); only a check deselected as slow (``run_world``'s ``slow``)
    skips.
    """
    import pytest

    if key not in results:
        pytest.fail(f"{key!r} is not a check of this world (known: {sorted(results)})")
    res = results[key]
    if "skipped" in res:
        pytest.skip(res["skipped"])
    assert "error" not in res, res["error"]
    return res


def ranks(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's result of one check (from :func:`result_of`)."""
    assert len(res["ranks"]) >= 2, "results of every rank expected"
    for i, r in enumerate(res["ranks"]):
        r.setdefault("rank", i)
    return res["ranks"]


def _gathered(t: torch.Tensor, placement: Any, world: int) -> torch.Tensor:
    """The global tensor of a local shard (every rank takes part; replicated: itself)."""
    if not placement.is_shard:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return placement.unshard(parts)


def _gathered_grad(prm: torch.Tensor, placement: Any, world: int) -> torch.Tensor:
    return _gathered(prm.grad, placement, world)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element-wise difference, relative to the reference's largest magnitude."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius, in float64): an error relative to the whole tensor,
    where :func:`_rel`'s largest element would let a wrong small part of it hide.

    A reference that is exactly zero (the gradient of an embedding row no token reads)
    must be matched exactly: the error is then 0, or infinite."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    diff, norm = (a - b).norm().item(), b.norm().item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def probe_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss of a model's output that changes under a sign flip or any permutation.

    A scalar (the model's own loss) is used as is. Logits ``[..., n]``: mean
    cross-entropy against fixed random targets (``mean(out**2)`` would not see a
    negated or permuted output, nor would its gradients).
    """
    if out.dim() == 0:
        return out
    out = out.float()
    g = torch.Generator().manual_seed(1234)
    targets = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _output(out: Any) -> torch.Tensor:
    """The tensor to compare element-wise: HF outputs' logits, else the output itself."""
    return out.logits if hasattr(out, "logits") else out


def _grad_errors(model: torch.nn.Module, ref: torch.nn.Module, world: int) -> dict[str, float]:
    """Per parameter: the gathered gradient against the single-device one."""
    plan = model.boost_plan
    return {
        name: _rel(_gathered_grad(prm, plan.params[name], world), q.grad)
        for (name, prm), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    }


def _param_errors(model: torch.nn.Module, ref: torch.nn.Module, world: int) -> dict[str, float]:
    plan = model.boost_plan
    return {
        name: _rel(_gathered(prm.detach(), plan.params[name], world), q.detach())
        for (name, prm), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    }


def _replica_drift(model: torch.nn.Module) -> dict[str, float]:
    """Replicated parameters and their gradients: largest difference to rank 0's copy."""
    plan = model.boost_plan
    drift = {}
    for name, prm in model.named_parameters():
        if plan.params[name].is_shard:
            continue
        for what, t in (("", prm.detach()), (".grad", prm.grad)):
            if t is None:
                continue
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.contiguous())
            drift[name + what] = max((q - parts[0]).abs().max().item() for q in parts)
    return drift


def _worst(errs: dict[str, float]) -> tuple[float, str | None]:
    if not errs:
        return 0.0, None
    name = max(errs, key=lambda n: errs[n])
    return errs[name], name


def wire(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, list[int], str]]]:
    """Run ``fn``; the collectives that went over the wire: gloo events (name, shape, dtype)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        out = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name().startswith("gloo:")),
        key=lambda e: e.start_ns(),
    )
    return out, [
        (e.name(), list(e.shapes()[0]) if e.shapes() else [], (e.dtypes() or [""])[0])
        for e in events
    ]


def ops_run(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, list[int], str]]]:
    """Run ``fn``; the functional collectives it executed (any process group, fake too)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        out = fn()
    events = sorted(
        (
            e
            for e in prof.profiler.kineto_results.events()
            if e.name().startswith("_c10d_functional::") and "wait_tensor" not in e.name()
        ),
        key=lambda e: e.start_ns(),
    )
    return out, [
        (e.name().split("::")[1], list(e.shapes()[0]) if e.shapes() else [], e.dtypes()[0])
        for e in events
    ]


def _training_result(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    step: Callable[[torch.nn.Module], Any],
    *,
    world: int,
    steps: int,
    lr: float,
    loss_of: Callable[[Any], torch.Tensor],
    twin: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """SGD steps of the parallelized ``model`` vs ``ref`` (and ``twin``), every comparison.

    The second step's forward and backward also run under the profiler: the
    collectives on the wire (past any compile of the first step).
    """
    models_ = [m for m in (model, ref, twin) if m is not None]
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models_]
    res: dict[str, Any] = {
        "losses": [], "ref_losses": [], "out_err": [], "grad_err_steps": [], "noise": 0.0,
    }  # fmt: skip
    grad_errs: dict[str, float] = {}
    for i in range(steps):
        if i == 1:
            out, res["wire_fwd"] = wire(lambda: step(model))
        else:
            out = step(model)
        out_ref = step(ref)
        res["out_err"].append(_rel(_output(out), _output(out_ref)))
        loss, loss_ref = loss_of(out), loss_of(out_ref)
        for opt in opts:
            opt.zero_grad()
        if i == 1:
            res["wire_bwd"] = wire(loss.backward)[1]
        else:
            loss.backward()
        loss_ref.backward()
        if twin is not None:
            loss_of(step(twin)).backward()
            for t, q in zip(twin.parameters(), ref.parameters(), strict=True):
                res["noise"] = max(res["noise"], _rel(t.grad, q.grad))
        errs = _grad_errors(model, ref, world)
        res["grad_err_steps"].append(_worst(errs)[0])
        for n, e in errs.items():
            grad_errs[n] = max(grad_errs.get(n, 0.0), e)
        for opt in opts:
            opt.step()
        res["losses"].append(loss.item())
        res["ref_losses"].append(loss_ref.item())
    param_errs = _param_errors(model, ref, world)
    res["loss_err"] = max(
        abs(a - b) / abs(b) for a, b in zip(res["losses"], res["ref_losses"], strict=True)
    )
    res["grad_err"], res["grad_worst"] = _worst(grad_errs)
    res["param_err"], res["param_worst"] = _worst(param_errs)
    res["grad_errs"], res["param_errs"] = grad_errs, param_errs
    res["replica_drift"] = _replica_drift(model)
    res["rank"] = dist.get_rank()
    return res


def compare_training(
    maker: str, compiled: bool, *, world: int, mesh: Any, steps: int = 3, lr: float = 0.1,
    lowering: str = "inductor",
) -> dict[str, Any]:  # fmt: skip
    """SGD steps of the parallelized model vs the single-device model, same data.

    Compared on this rank, every step: the output element-wise, the loss
    (:func:`probe_loss`), every gathered gradient; after the last step every
    gathered parameter; replicated parameters and gradients against rank 0's.
    ``compiled``: through ``torch.compile(backend="boost")``, lowered by ``lowering``.
    """
    import boost_compiler
    from tests import models

    warned = _WarningLog()
    model, inputs = getattr(models, maker)()
    ref = copy.deepcopy(model)
    takes_labels = hasattr(model, "cfg")
    kw = {"labels": inputs[0]} if takes_labels else {}
    boost_compiler.parallelize(model, mesh, inputs, kw or None)
    plan = model.boost_plan
    run = _compiled(model, lowering) if compiled else model

    def step(m: torch.nn.Module) -> Any:
        return (run if m is model else m)(*inputs, **kw)

    res = _training_result(model, ref, step, world=world, steps=steps, lr=lr, loss_of=probe_loss)
    return {**res, "fallbacks": plan.fallbacks, "warnings": warned.close(), **_sharded(plan)}


def _compiled(model: torch.nn.Module, lowering: str) -> Any:
    """``torch.compile(backend="boost")``; ``lowering="eager"`` runs the same rewritten
    dynamo graphs without Inductor (no cold Inductor compile on a 2-core CI machine)."""
    options = None if lowering == "inductor" else {"lowering": lowering}
    return torch.compile(model, backend="boost", options=options)


def _sharded(plan: Any) -> dict[str, dict[str, str]]:
    """The plan's split parameters and their placements (``"S(0)"``), for rule checks."""
    return {"sharded": {n: str(pl) for n, pl in plan.params.items() if pl.is_shard}}


class _WarningLog(logging.Handler):
    """Warnings of the ``boost_compiler`` logger while a check runs (fallbacks at any stage)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("boost_compiler").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def close(self) -> list[str]:  # type: ignore[override]
        logging.getLogger("boost_compiler").removeHandler(self)
        super().close()
        return self.messages


def other_shapes_and_kwargs(
    compiled: bool, *, world: int, mesh: Any, lowering: str = "inductor"
) -> dict[str, Any]:
    """Parallelize with one example, then train on other batch/seq sizes, labels, eval.

    Each new shape: forward, then backward of :func:`probe_loss`, compared to the
    single-device model element-wise (output and every gathered gradient); warnings
    of the ``boost_compiler`` logger (a fallback at any compile) are returned.
    Compiled (``dynamic=True``: one graph with symbolic batch and sequence sizes,
    so the sharding rules run on SymInts), the two new shapes only: each extra
    graph costs a full compile on a 2-core CI machine. ``lowering="eager"`` runs
    the same symbolic graphs without Inductor.
    """
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    warned = _WarningLog()
    model = build("tiny", seed=1)
    ref = copy.deepcopy(model)
    cfg = model.cfg
    boost_compiler.parallelize(model, mesh, example_inputs(cfg, batch=2, seq=16))
    options = {"lowering": lowering}
    run = (
        torch.compile(model, backend="boost", dynamic=True, options=options) if compiled else model
    )

    def compare(ids: torch.Tensor, **kw: Any) -> dict[str, float]:
        for m in (model, ref):
            m.zero_grad()
        out, out_ref = run(ids, **kw), ref(ids, **kw)
        probe_loss(out).backward()
        probe_loss(out_ref).backward()
        return {"out": _rel(out, out_ref), "grad": _worst(_grad_errors(model, ref, world))[0]}

    errs = {}
    for name, (b, s) in {"batch3": (3, 16), "seq24": (2, 24), "b1s8": (1, 8)}.items():
        if compiled and b == 1:
            continue  # size 1 is always specialised: a second graph, no new coverage
        (ids,) = example_inputs(cfg, batch=b, seq=s, seed=b * 100 + s)
        errs[name] = compare(ids)
    if not compiled:
        (ids,) = example_inputs(cfg, batch=2, seq=16, seed=7)
        errs["labels"] = compare(ids, labels=ids)
        model.eval()
        ref.eval()
        with torch.no_grad():
            errs["eval_no_grad"] = {"out": _rel(run(ids), ref(ids))}
    plan = model.boost_plan
    return {"errs": errs, "fallbacks": plan.fallbacks, "warnings": warned.close()}


def passes_on_vs_off(*, world: int, mesh: Any, steps: int = 3) -> dict[str, Any]:
    """Compiled, default passes vs ``group_linears``/``online_norm`` off: same numbers.

    Lowered eagerly: the passes act on the dynamo graph, before any lowering, and
    the Inductor-lowered default passes are checked against one device by
    :func:`compare_training` (``make_cola_llama/compiled``) and tests/test_seams.py.
    """
    import boost_compiler
    from tests import models

    model, inputs = models.make_cola_llama(seed=3)
    off = copy.deepcopy(model)
    kw = {"labels": inputs[0]}
    for m in (model, off):
        boost_compiler.parallelize(m, mesh, inputs, kw)
    eager = {"lowering": "eager"}
    off_opts = {**eager, "group_linears": False, "online_norm": False}
    runs = [
        torch.compile(model, backend="boost", options=eager),
        torch.compile(off, backend="boost", options=off_opts),
    ]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, off)]
    loss_err = grad_err = 0.0
    wires: dict[str, list] = {}
    for i in range(steps):
        losses = [run(*inputs, **kw) for run in runs]
        if i == 1:  # what runs, each model: forward (again, compiled), backward
            for name, run in zip(("on", "off"), runs, strict=True):
                wires[f"{name}_fwd"] = wire(lambda run=run: run(*inputs, **kw))[1]
        for name, opt, loss in zip(("on", "off"), opts, losses, strict=True):
            opt.zero_grad()
            if i == 1:
                wires[f"{name}_bwd"] = wire(loss.backward)[1]
            else:
                loss.backward()
        loss_err = max(loss_err, abs(losses[0].item() - losses[1].item()) / losses[1].item())
        for p, q in zip(model.parameters(), off.parameters(), strict=True):
            grad_err = max(grad_err, _rel(p.grad, q.grad))
        for opt in opts:
            opt.step()
    return {"loss_err": loss_err, "grad_err": grad_err, "wire": wires, "layers": model.cfg.n_layers}


def two_instances(*, world: int, mesh: Any) -> dict[str, Any]:
    """Two parallelized models of one class share a compiled graph, never their shards."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    models = [build("tiny", seed=s) for s in (11, 12)]
    refs = [copy.deepcopy(m) for m in models]
    (ids,) = example_inputs(models[0].cfg, batch=2, seq=16)
    errs = []
    for m in models:
        boost_compiler.parallelize(m, mesh, (ids,))
    runs = [torch.compile(m, backend="boost", options={"lowering": "eager"}) for m in models]
    for run, ref in zip(runs, refs, strict=True):
        errs.append(_rel(run(ids), ref(ids)))
    return {"errs": errs}


def bf16_accuracy(*, world: int, mesh: Any, steps: int = 3) -> dict[str, Any]:
    """bf16 activations: TP (fused fp32 statistics payload) vs one device, both vs fp32.

    The parallel run's distance to the fp32 reference should be that of the
    single-device bf16 run, for the losses of every step and for the first
    step's gathered gradients: the online norm must not add error of its own.
    ``wire``: the all-reduces the second TP step ran (gloo events: shape, dtype).
    """
    import boost_compiler
    from tests import models

    ref32, inputs = models.make_cola_llama(seed=4)
    single = copy.deepcopy(ref32).to(torch.bfloat16)
    model = copy.deepcopy(single)
    kw = {"labels": inputs[0]}
    boost_compiler.parallelize(model, mesh, inputs, kw)
    plan = model.boost_plan
    losses: dict[str, list[float]] = {"fp32": [], "single_bf16": [], "tp_bf16": []}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    wired: list = []
    for name, m in (("fp32", ref32), ("single_bf16", single), ("tp_bf16", model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(steps):
            if m is model and i == 1:
                loss, fwd = wire(lambda m=m: m(*inputs, **kw))
                wired += fwd
            else:
                loss = m(*inputs, **kw)
            opt.zero_grad()
            loss.backward()
            if i == 0:
                grads[name] = {
                    n: (_gathered_grad(p, plan.params[n], world) if m is model else p.grad).float()
                    for n, p in m.named_parameters()
                }
            opt.step()
            losses[name].append(loss.float().item())

    def err(name: str) -> float:
        return max(abs(a - b) / b for a, b in zip(losses[name], losses["fp32"], strict=True))

    def grad_err(name: str, against: str = "fp32") -> float:
        return max(_rel(grads[name][n], grads[against][n]) for n in grads["fp32"])

    return {
        "losses": losses,
        "single_bf16_err": err("single_bf16"),
        "tp_bf16_err": err("tp_bf16"),
        "tp_vs_single": max(
            abs(a - b) / b for a, b in zip(losses["tp_bf16"], losses["single_bf16"], strict=True)
        ),
        "single_bf16_grad_err": grad_err("single_bf16"),
        "tp_bf16_grad_err": grad_err("tp_bf16"),
        "tp_vs_single_grad": grad_err("tp_bf16", "single_bf16"),
        "wire": wired,
        "rank_dim": model.cfg.rank,
        "layers": model.cfg.n_layers,
    }


_COLLECTIVE_OPS = {
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_reduce_.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def checkpoint_modes(
    full: bool = False, *, world: int, mesh: Any, steps_time: int = 0
) -> dict[str, Any]:
    """Saved-activation bytes, backward collectives and numbers for checkpoint off/on/full.

    CoLA-LLaMA at d=256, r=64, b=2, s=128 (the issue's size), compiled; each mode's
    loss and gathered gradients (per parameter, element-wise) against the
    single-device model run eagerly, without the boost backend. Bytes
    per layer are the increment from 1 to 2 layers, so the embedding, final norm
    and LM head cancel. Saved tensors are what the compiled forward hands to
    autograd for the backward (``saved_tensors_hooks``), parameters excluded.
    """
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    out: dict[str, Any] = {}
    for layers in (1, 2):
        ref = build("tiny", seed=5, d_model=256, rank=64, d_ff=688, n_layers=layers)
        (ids,) = example_inputs(ref.cfg, batch=2, seq=128, seed=6)
        single = copy.deepcopy(ref)  # the reference: one device, eager, no boost backend
        single_loss = single(ids, labels=ids)
        single_loss.backward()
        for mode in (False, True, "full") if full else (False, True):
            model = copy.deepcopy(ref)
            boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})
            graphs: list[int] = []  # collectives per Inductor graph: [forward, backward]
            record = {"post_grad_custom_pre_pass": lambda g, graphs=graphs: graphs.append(
                sum(n.target in _COLLECTIVE_OPS for n in g.nodes)
            )}  # fmt: skip
            options = {"checkpoint": mode, "inductor_config": record}
            run = torch.compile(model, backend="boost", options=options)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor, saved=saved, params=params) -> torch.Tensor:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    saved[ptr] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = run(ids, labels=ids)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss.backward()
            gloo = sum(e.name.startswith("gloo:") for e in prof.events())
            plan = model.boost_plan
            grad_errs = {
                n: _rel(_gathered_grad(p, plan.params[n], world), q.grad)
                for (n, p), q in zip(model.named_parameters(), single.parameters(), strict=True)
            }
            times = []
            for _ in range(steps_time):  # step time, for the benchmark (median)
                start = time.perf_counter()
                run(ids, labels=ids).backward()
                times.append(time.perf_counter() - start)
            out[f"{mode}/{layers}"] = {
                "graph_collectives": graphs,
                "step_s": sorted(times)[len(times) // 2] if times else None,
                "saved": sum(saved.values()),
                "bwd_collectives": gloo,
                "loss": loss.item(),
                "loss_err": abs(loss.item() - single_loss.item()) / abs(single_loss.item()),
                "grad_errs": grad_errs,
            }
    res: dict[str, Any] = {}
    for mode in ("False", "True", "full") if full else ("False", "True"):
        res[f"per_layer_{mode}"] = out[f"{mode}/2"]["saved"] - out[f"{mode}/1"]["saved"]
    for mode in ("False", "True", "full") if full else ("False", "True"):
        run_ = out[f"{mode}/2"]
        res[f"step_s_{mode}"] = run_["step_s"]
        res[f"bwd_collectives_{mode}"] = run_["bwd_collectives"]
        res[f"graph_collectives_{mode}"] = run_["graph_collectives"]
        # against the single-device eager model: the loss, every gathered gradient
        res[f"loss_err_{mode}"] = run_["loss_err"]
        res[f"grad_err_{mode}"], res[f"grad_worst_{mode}"] = _worst(run_["grad_errs"])
    res["ratio"] = res["per_layer_True"] / res["per_layer_False"]
    return res


def dropout_masks(compiled: bool, *, world: int, mesh: Any) -> dict[str, Any]:
    """Dropout on: the replicated latent agrees across ranks, shard masks do not repeat."""
    import boost_compiler
    from tests.models import DropoutCola

    torch.manual_seed(100 + dist.get_rank())  # ranks start from different streams
    model = DropoutCola()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    boost_compiler.parallelize(model, mesh, (ids,))
    run = torch.compile(model, backend="boost") if compiled else model
    latent_diffs, same_mask, drop_rate = [], [], []
    for _ in range(2):
        logits, latent, dropped = run(ids)
        logits.float().pow(2).mean().backward()
        parts = [torch.empty_like(latent) for _ in range(world)]
        dist.all_gather(parts, latent.contiguous())
        latent_diffs.append(max((q - parts[0]).abs().max().item() for q in parts))
        zeros = (dropped == 0).chunk(world, dim=-1)  # dropped is the gathered global tensor
        same_mask.append(all(torch.equal(zeros[0], z) for z in zeros[1:]))
        drop_rate.append((latent == 0).float().mean().item())
    return {"latent_diff": latent_diffs, "same_mask": same_mask, "drop_rate": drop_rate}


def param_memory(*, world: int, mesh: Any) -> dict[str, Any]:
    """Bytes per rank, and which parameters the rank holds whole, read off the tensors."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    model = build("tiny", seed=2)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    boost_compiler.parallelize(model, mesh, example_inputs(model.cfg))
    local = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {
        "total": total,
        "local": sum(p.numel() * p.element_size() for p in model.parameters()),
        "global_shapes": shapes,
        "local_shapes": local,
        "replicated": sorted(n for n in shapes if local[n] == shapes[n]),
    }


def _worker(rank: int, world: int, store: str, checks: list[tuple], out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A rank waits at most for its peers' compiles (compile_in_turns); a hang from a
    # mismatched collective then fails in 10 minutes, not gloo's default 30.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    for key, fn_name, args, *kwargs in checks:
        torch.manual_seed(0)
        # Each check starts from dynamo's state in a fresh process: compiled models of
        # earlier checks would otherwise count against recompile_limit on the frames
        # they share (HF's wrapper code objects; frames compiled under other backends
        # and options), and parallelize makes reaching that limit an error.
        torch._dynamo.reset()
        try:
            results[key] = _check_fn(fn_name)(
                *args, **(kwargs[0] if kwargs else {}), world=world, mesh=mesh
            )
        except Exception:  # reported to the test, which fails with the traceback
            results[key] = {"error": traceback.format_exc()}
        # Written after every check, so that what ran survives an abort; atomically,
        # since mp.spawn terminates the other ranks once one exits with an error.
        Path(f"{out}.{rank}.tmp").write_text(json.dumps(results))
        os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")
        if "error" in results[key]:
            # A rank that failed mid-check may have left its peers inside a collective;
            # going on would pair later checks' collectives wrongly (garbage or a hang).
            # Exiting closes the connections: the peers' pending collectives fail fast,
            # and run_world reports the later checks as not run, naming this one.
            os._exit(1)
    dist.destroy_process_group()


def _check_fn(name: str) -> Any:
    """A check of this module by name, or ``"package.module:function"`` of another."""
    if ":" in name:
        import importlib

        module, fn = name.split(":")
        return getattr(importlib.import_module(module), fn)
    return globals()[name]


def run_world(
    world: int, checks: list[tuple], slow: Iterable[str] = ()
) -> dict[str, dict[str, Any]]:
    """Spawn ``world`` ranks once; per check, the ranks' results combined, each under ``"ranks"``.

    ``checks``: ``(key, function, args[, kwargs])``. Keys in ``slow`` (each must be
    a key of ``checks``) run only with ``BOOST_FULL_TESTS=1``; otherwise their
    result is ``{"skipped": reason}``. The first failed check stops the world: its
    error is reported from the rank(s) where it happened, and every later check
    gets an error saying it did not run.
    """
    slow = set(slow)
    keys = [key for key, *_ in checks]
    assert len(set(keys)) == len(keys), f"duplicate check keys: {keys}"
    assert slow <= set(keys), f"slow keys that are no check: {sorted(slow - set(keys))}"
    skipped = {k: {"skipped": f"{k}: {SLOW_REASON}"} for k in keys if k in slow and not FULL_TESTS}
    checks = [c for c in checks if c[0] not in skipped]
    tmp = tempfile.mkdtemp(prefix="boost-tp-")
    store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
    if checks:
        try:
            mp.spawn(_worker, args=(world, store, checks, out), nprocs=world, join=True)
        except mp.ProcessExitedException as exc:  # a check failed: see the per-rank results
            logging.getLogger(__name__).warning("run_world: %s", exc)
    per_rank = [_read_results(f"{out}.{r}") for r in range(world)]
    results: dict[str, dict[str, Any]] = dict(skipped)
    failed = None
    for key, *_ in checks:
        errors = [
            f"rank {r}: {res[key]['error']}"
            for r, res in enumerate(per_rank)
            if isinstance(res.get(key), dict) and "error" in res[key]
        ]
        if errors:
            after = f"(after check {failed!r} failed) " if failed else ""
            results[key] = {"error": after + "\n".join(errors)}
            failed = failed or key
        elif any(key not in res for res in per_rank):
            why = f"after check {failed!r} failed" if failed else "(a rank died: see the log)"
            results[key] = {"error": f"not run: the ranks stopped {why}"}
        else:
            each = [res[key] for res in per_rank]
            results[key] = {**across_ranks(each), "ranks": each}
    return results


class RanksDisagree:
    """A value the ranks did not agree on: equal to nothing, false, shown with every rank's."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return (
            "RanksDisagree("
            + ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(self.values))
            + ")"
        )


def _combine(values: list[Any]) -> Any:
    """One value for every rank's: a float the worst (largest) of them, element-wise in lists
    and dicts; anything else must be equal on every rank, or it is :class:`RanksDisagree`."""
    first = values[0]
    if all(v == first for v in values[1:]):
        return first
    if all(isinstance(v, float) for v in values):
        return max(values)
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [_combine(list(col)) for col in zip(*values, strict=True)]
    if all(isinstance(v, dict) for v in values) and len({tuple(v) for v in values}) == 1:
        return {k: _combine([v[k] for v in values]) for k in first}
    return RanksDisagree(values)


def across_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A check's result as the test reads it: every key combined over all ranks.

    Why: a test that reads ``res["loss_err"]`` must see every rank's, not rank 0's
    alone (a rank-dependent bug would stay green), and no test should have to
    remember to loop over the ranks for it. Errors are the worst rank's; counts,
    names and flags must agree on every rank (the ``"rank"`` key itself excepted).
    """
    keys = [k for k in per_rank[0] if all(k in r for r in per_rank)]
    out = {k: _combine([r[k] for r in per_rank]) for k in keys if k != "rank"}
    out.update({k: RanksDisagree([r.get(k) for r in per_rank])
                for k in set().union(*per_rank) - set(keys)})  # fmt: skip
    return out


def _read_results(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text()) if os.path.exists(path) else {}


def compare_training_hf(
    maker: str, compiled: bool, *maker_args: Any, world: int, mesh: Any, steps: int = 3,
    lr: float = 1e-3, padded: bool = False, lowering: str = "inductor",
) -> dict[str, Any]:  # fmt: skip
    """:func:`compare_training` for models called with ``labels=`` that return ``.loss``.

    ``tests.models.<maker>(0, *maker_args)`` builds the model (Hugging Face
    ``*ForCausalLM`` after conversion, or any model whose output has ``loss``
    and ``logits``). The loss is the model's own (HF's causal-LM loss function),
    so the label shift, flattening and cross-entropy run inside the sharded
    graph. Compared as :func:`compare_training` does (logits every step), and
    ``noise``: the gradient error of a single-device twin whose parameters were
    perturbed by 1e-7 relative (what fp32 rounding alone does to this model).

    Why ``lr=1e-3`` (``compare_training`` uses 0.1): HF's initialisation (embedding
    std 0.02, so the norms divide by a small rms) makes these tiny models chaotic
    under large steps. Measured on the converted GPT-2, the twin's gradient error
    is 3.5e-6 at the first step and reaches 2-3e-5 at the third with lr=0.01
    (Llama: 1.8e-5 at lr=0.1): fp32 reordering alone would fail a 1e-5 bound.
    At 1e-3 it stays at 2-4e-6, and the parameters still move by a few percent.

    ``padded``: a left-padded batch, as batched generation or packed fine-tuning
    data bring: ``attention_mask`` zero on the first tokens of one row, the
    ``position_ids`` that count only real tokens, labels -100 on the padding;
    and ``use_cache=False``, as training should call HF models.
    """
    import boost_compiler
    from tests import models

    clock = _Clock()
    warned = _WarningLog()
    model, inputs = getattr(models, maker)(0, *maker_args)
    ref = copy.deepcopy(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for prm in twin.parameters():
            prm.mul_(1 + 1e-7 * torch.randn(prm.shape, generator=g))
    kw: dict[str, Any] = {"labels": inputs[0]}
    if padded:
        mask = torch.ones_like(inputs[0])
        mask[-1, :5] = 0
        kw = {
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
            "labels": inputs[0].masked_fill(mask == 0, -100),
            "use_cache": False,  # training: no keys/values returned, none gathered
        }
    shapes = {n: p.shape for n, p in model.named_parameters()}
    boost_compiler.parallelize(model, mesh, inputs, kw)
    plan = model.boost_plan
    run = _compiled(model, lowering) if compiled else model

    def step(m: torch.nn.Module) -> Any:
        return (run if m is model else m)(*inputs, **kw)

    res = _training_result(
        model, ref, step, world=world, steps=steps, lr=lr, loss_of=lambda o: o.loss, twin=twin
    )
    held_whole = [n for n, p in model.named_parameters() if p.shape == shapes[n]]
    return {
        **res,
        "logits_err": max(res["out_err"]),
        "fallbacks": plan.fallbacks,
        "warnings": warned.close(),
        "replicated": held_whole,  # read off the local tensors, not the plan
        **_sharded(plan),
        "bottlenecks": len(plan.bottlenecks),
        "collectives": [
            (c.kind, c.reason, c.forward, c.backward, list(c.global_shape))
            for c in plan.collectives
        ],
        **clock.read(),
    }


def hf_decode_with_cache(*, world: int, mesh: Any) -> dict[str, Any]:
    """Incremental decoding of a parallelized HF Llama: prefix, then tokens with its cache.

    The cache leaves the graph gathered (graph outputs are global tensors), so
    the second call receives replicated past keys/values that are concatenated
    with this step's head-sharded ones: the ``cat`` rule slices them locally.
    """
    import boost_compiler
    from tests import models

    clock = _Clock()
    warned = _WarningLog()
    model, (ids,) = models.make_hf(0, "llama", "sdpa", 1)
    ref = copy.deepcopy(model)
    boost_compiler.parallelize(model, mesh, (ids,))
    model.eval()
    ref.eval()
    errs = []
    with torch.no_grad():
        out, out_ref = model(ids[:, :5], use_cache=True), ref(ids[:, :5], use_cache=True)
        errs.append(_rel(out.logits, out_ref.logits))
        for t in range(5, ids.shape[1]):
            step = ids[:, t : t + 1]
            out = model(step, cache=out.cache, use_cache=True)
            out_ref = ref(step, cache=out_ref.cache, use_cache=True)
            errs.append(_rel(out.logits, out_ref.logits))
    plan = model.boost_plan
    return {"errs": errs, "fallbacks": plan.fallbacks, "warnings": warned.close(), **clock.read()}


def passes_step_time(*, world: int, mesh: Any, steps: int = 10, warmup: int = 2) -> dict[str, Any]:
    """Compiled step time, default passes vs group_linears/online_norm off, interleaved.

    The reference decoder (d=256, d_ff=688, r=64, 2 layers, b=2, s=64), SGD steps;
    the two models alternate step by step so background load hits both alike.
    """
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    ref = build("tiny", seed=9, d_model=256, rank=64, d_ff=688, n_layers=2)
    (ids,) = example_inputs(ref.cfg, batch=2, seq=64, seed=10)
    off = {"group_linears": False, "online_norm": False}
    runs, opts = {}, {}
    for name, options in (("on", {}), ("off", off)):
        model = copy.deepcopy(ref)
        boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}, options=options)
        runs[name] = torch.compile(model, backend="boost", options=options)
        opts[name] = torch.optim.SGD(model.parameters(), lr=0.01)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for step in range(warmup + steps):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            loss = run(ids, labels=ids)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"median_s": med, "ratio_off_over_on": med["off"] / med["on"], "times": times}


class _Clock:
    """Wall and CPU seconds of one check on this rank (CPU includes Inductor's compiler
    subprocesses), for sizing the suite on a loaded machine, where wall time lies."""

    def __init__(self) -> None:
        import time

        self._wall, self._cpu = time.perf_counter(), self._cpu_now()

    @staticmethod
    def _cpu_now() -> float:
        import resource

        own, children = (
            resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def read(self) -> dict[str, float]:
        import time

        return {"seconds": time.perf_counter() - self._wall, "cpu_s": self._cpu_now() - self._cpu}
