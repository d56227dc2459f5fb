"""Checkpoint regions and misuse at tp=2 (issue 13, parts 2 and 3).

HF Llama with ``gradient_checkpointing_enable()`` against the same model on one
device; the collectives that run (profiler ``gloo:*`` events) with and without
checkpointing; ``parallelize`` twice; a model built on the meta device,
materialised and loaded from a full state dict.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.mutation_checks import _gather, _rel


def _gloo_events(fn: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("gloo:"))


def _compare(
    model: nn.Module, ref: nn.Module, ids: torch.Tensor, world: int, steps: int = 2,
    labels_of: Any = None, lr: float = 0.1, run: Any = None,
):  # fmt: skip
    """SGD steps of a parallelized HF model against its single-device copy, every value;
    ``run``: what is called for the parallel model (e.g. its ``torch.compile``)."""
    runner = model if run is None else run  # not `run or model`: a compiled module has no bool
    plan = model.boost_plan
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    errs = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        labels = ids.roll(step + 1, dims=1) if labels_of is None else labels_of(step)
        out = runner(ids, labels=labels, use_cache=False)
        out_ref = ref(ids, labels=labels, use_cache=False)
        errs["logits"] = max(errs["logits"], _rel(out.logits.detach(), out_ref.logits.detach()))
        errs["loss"] = max(errs["loss"], _rel(out.loss.detach(), out_ref.loss.detach()))
        opt.zero_grad()
        opt_ref.zero_grad()
        out.loss.backward()
        out_ref.loss.backward()
        for (name, prm), (_, q) in zip(
            model.named_parameters(), ref.named_parameters(), strict=True
        ):
            errs["grad"] = max(
                errs["grad"], _rel(_gather(prm.grad, plan.params[name], world), q.grad)
            )
        opt.step()
        opt_ref.step()
    for (name, prm), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        errs["param"] = max(errs["param"], _rel(_gather(prm.detach(), plan.params[name], world), q))
    return errs


def hf_gradient_checkpointing(*, world: int, mesh: Any) -> dict[str, Any]:
    """Llama (CoLA factors) with HF's gradient checkpointing, and the same model without."""
    import boost_compiler
    from tests.models import make_hf

    out: dict[str, Any] = {}
    for checkpointed in (False, True):
        model, (ids,) = make_hf(seed=0, family="llama")
        if checkpointed:
            model.gradient_checkpointing_enable()
            # Modules wrapped by the `kernels` package's use_kernelized_func (when installed):
            # each sets a ContextVar in its forward, inside the checkpoint region.
            out["kernelized"] = sum("_kernel_funcs" in m.__dict__ for m in model.modules())
        model.train()
        ref = copy.deepcopy(model)
        kwargs = {"labels": ids, "use_cache": False}
        boost_compiler.parallelize(model, mesh, (ids,), kwargs)
        key = "checkpointed" if checkpointed else "plain"
        forward = _gloo_events(lambda m=model, i=ids, kw=kwargs: m(i, **kw))
        out[key] = {
            **_compare(model, ref, ids, world),
            "bottlenecks": len(model.boost_plan.bottlenecks),
            "fallbacks": list(model.boost_plan.fallbacks),
            "forward_collectives": forward,
        }
    return out


def parallelize_twice(*, world: int, mesh: Any) -> dict[str, Any]:
    import boost_compiler
    from tests.models import make_cola_llama

    model, inputs = make_cola_llama()
    boost_compiler.parallelize(model, mesh, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res: dict[str, Any] = {}
    for what, target in (("model", model), ("submodule", model.layers[0])):
        try:
            boost_compiler.parallelize(target, mesh, inputs if what == "model" else ())
            res[what] = None
        except boost_compiler.errors.AlreadyParallelizedError as exc:
            res[what] = str(exc)
    res["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return res


def meta_device(*, world: int, mesh: Any) -> dict[str, Any]:
    """Parallelize on meta, materialise with to_empty, load the full state dict, train."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    ref = build("tiny", seed=3)
    full = ref.state_dict()
    with torch.device("meta"):
        model = build("tiny", seed=3)
    (ids,) = example_inputs(ref.cfg)
    meta_ids = ids.to("meta")
    boost_compiler.parallelize(model, mesh, (meta_ids,), {"labels": meta_ids})
    on_meta = {n: p.is_meta for n, p in model.named_parameters()}
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.to_empty(device="cpu")
    # the RoPE tables are non-persistent buffers: no state dict restores them (without this
    # the check read uninitialised memory, and failed whenever it was not zeros)
    model.rope.reset_parameters()
    boost_compiler.load_state_dict(model, full)
    plan = model.boost_plan
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    errs = {"loss": 0.0, "grad": 0.0}
    for step in range(2):
        labels = ids.roll(step + 1, dims=1)
        loss, loss_ref = model(ids, labels=labels), ref(ids, labels=labels)
        errs["loss"] = max(errs["loss"], _rel(loss.detach(), loss_ref.detach()))
        opt.zero_grad()
        opt_ref.zero_grad()
        loss.backward()
        loss_ref.backward()
        for (name, prm), (_, q) in zip(
            model.named_parameters(), ref.named_parameters(), strict=True
        ):
            errs["grad"] = max(
                errs["grad"], _rel(_gather(prm.grad, plan.params[name], world), q.grad)
            )
        opt.step()
        opt_ref.step()
    # Independent of the plan: with the loss in the graph, BTP splits every parameter of
    # the CoLA-LLaMA (factors on their wide dims, norms and embedding on the hidden, the
    # head on the vocabulary), so each rank holds exactly 1/p of the model's bytes.
    expected = sum(t.numel() * t.element_size() for t in full.values()) // world
    dist.barrier()
    return {**errs, "all_meta": all(on_meta.values()), "local_bytes": local_bytes,
            "expected_bytes": expected}  # fmt: skip


def meta_reset_parameters(*, world: int, mesh: Any) -> dict[str, Any]:
    """Meta -> to_empty -> boost_compiler.reset_parameters equals a single-device reset."""
    import boost_compiler
    from tests.mutation_checks import ResidualMul, _inputs

    with torch.device("meta"):
        model = ResidualMul()
    (x,) = _inputs()
    boost_compiler.parallelize(model, mesh, (x.to("meta"),))
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    reset = boost_compiler.reset_parameters(model)
    ref = ResidualMul()
    torch.manual_seed(5)
    for mod in ref.modules():
        if callable(getattr(mod, "reset_parameters", None)):
            mod.reset_parameters()
    plan = model.boost_plan
    init_err = max(
        _rel(_gather(p.detach(), plan.params[n], world), q)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    )
    out_err = _rel(model(x).detach(), ref(x).detach())
    return {"reset": reset, "init_err": init_err, "out_err": out_err}
