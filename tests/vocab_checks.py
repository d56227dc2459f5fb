"""Vocabulary-parallel LM head and sharded cross-entropy at tp=2 (issue 15, part 1).

Each check trains 3 SGD steps against an untouched single-device copy and
compares the loss, every gathered gradient and every parameter after the last
step, on every rank; it also reports the head's placement and the plan's
decisions, so a test can tell the vocabulary-parallel path ran.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from tests.mutation_checks import _gather, _rel


def _train(model, ref, step_fn, ref_fn, world: int, steps: int = 3) -> dict[str, Any]:
    plan = model.boost_plan
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        loss, loss_ref = step_fn(step), ref_fn(step)
        errs["loss"] = max(errs["loss"], _rel(loss.detach(), loss_ref.detach()))
        opt.zero_grad()
        opt_ref.zero_grad()
        loss.backward()
        loss_ref.backward()
        for (name, prm), (_, q) in zip(
            model.named_parameters(), ref.named_parameters(), strict=True
        ):
            g = _gather(prm.grad, plan.params[name], world)
            errs["grad"] = max(errs["grad"], _rel(g, q.grad))
        opt.step()
        opt_ref.step()
    for (name, prm), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        errs["param"] = max(errs["param"], _rel(_gather(prm.detach(), plan.params[name], world), q))
    return errs


def _head(model) -> str:
    params = model.boost_plan.params  # a tied head is listed under the embedding's name
    return str(params.get("lm_head.weight", params.get("embed.weight")))


def cola_labels(
    lowering: str | None, tied: bool = False, *, world: int, mesh: Any
) -> dict[str, Any]:
    """The example CoLA-LLaMA's own ``labels=`` loss (shift, reshape, fp32 upcast);
    ``tied``: its embedding and head share one weight."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    # Tied: V=512 > 4d, where the vocabulary split is chosen for the shared weight.
    model = build("tiny", seed=2, **({"tie_embeddings": True, "vocab_size": 512} if tied else {}))
    ref = copy.deepcopy(model)
    (ids,) = example_inputs(model.cfg)
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})
    run = model
    if lowering is not None:
        run = torch.compile(model, backend="boost", options={"lowering": lowering})

    def labels(step: int) -> torch.Tensor:
        return ids.roll(step, dims=1)

    errs = _train(model, ref, lambda k: run(ids, labels=labels(k)), lambda k: ref(ids, labels=labels(k)), world)  # fmt: skip
    return {**errs, "head": _head(model), "tokens": ids.numel(), "vocab": model.cfg.vocab_size,
            "ids_shape": list(ids.shape), "decisions": model.boost_plan.decisions,
            "fallbacks": model.boost_plan.fallbacks,
            "wire": _wire(lambda: run(ids, labels=ids))}  # fmt: skip


def _wire(loss_fn: Any) -> list[tuple[str, list, str, bool]]:
    """(collective, shape, dtype, backward?) of every gloo event of one more step.

    gloo records a collective's *input*: an all-gather's shape is the local piece
    (the test also checks the element count, which a gathered ``[.., V/p]`` shard
    would give away), and a reduce-scatter shows as an all-reduce of the full input.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = loss_fn()
        with record_function("check::backward"):
            loss.backward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    bwd = [e.time_range for e in events if e.name == "check::backward"]
    out = []
    for e in events:
        if e.name.startswith("gloo:"):
            back = any(r.start <= e.time_range.start <= r.end for r in bwd)
            shape = list(e.input_shapes[0]) if e.input_shapes else []
            dtype = e.input_dtypes[0] if e.input_dtypes else ""
            out.append((e.name, shape, dtype, back))
    return out


def gpt2_tied_logits(*, world: int, mesh: Any) -> dict[str, Any]:
    """GPT-2 with SVD factors, tied embedding and head, returning logits (no loss in the
    graph): compared by a cross-entropy against fixed targets outside the model."""
    import boost_compiler
    from tests.models import make_gpt2_svd

    model, (ids,) = make_gpt2_svd(seed=5, vocab=512, d=64)
    ids = torch.randint(0, 512, ids.shape, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    boost_compiler.parallelize(model, mesh, (ids,))
    targets = torch.randint(0, 512, ids.shape, generator=torch.Generator().manual_seed(3))

    def loss(m: Any, step: int) -> torch.Tensor:
        return F.cross_entropy(m(ids).flatten(0, 1), targets.roll(step, 1).flatten())

    errs = _train(model, ref, lambda k: loss(model, k), lambda k: loss(ref, k), world)
    return {**errs, "head": str(model.boost_plan.params["wte.weight"]),
            "decisions": model.boost_plan.decisions, "fallbacks": model.boost_plan.fallbacks,
            "wire": _wire(lambda: loss(model, 0)), "tokens": ids.numel(), "vocab": 512,
            "ids_shape": list(ids.shape)}  # fmt: skip


def user_train_step(
    reduction: str, smoothing: float, lowering: str = "eager", *, world: int, mesh: Any
) -> dict[str, Any]:
    """A user's compiled step: ``F.cross_entropy(model(x).view(-1, V), y)`` outside the model."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    model = build("tiny", seed=4)
    ref = copy.deepcopy(model)
    (ids,) = example_inputs(model.cfg)
    vocab = model.cfg.vocab_size
    targets = torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(9))
    targets[0, :3] = -100  # ignored positions

    def loss_of(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            m(x).view(-1, vocab), y.view(-1), reduction=reduction, label_smoothing=smoothing
        )

    # Parallelize with the same step traced: the loss is in the graph, so the head splits.
    class Step(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_of(self.inner, x, y)

    step = Step(model)
    boost_compiler.parallelize(step, mesh, (ids, targets))
    compiled = torch.compile(step, backend="boost", options={"lowering": lowering})
    ref_step = Step(ref)
    errs = _train(
        step, ref_step, lambda k: compiled(ids, targets.roll(k, 1)),
        lambda k: ref_step(ids, targets.roll(k, 1)), world,
    )  # fmt: skip
    return {**errs, "head": str(step.boost_plan.params["inner.lm_head.weight"]),
            "decisions": step.boost_plan.decisions, "fallbacks": step.boost_plan.fallbacks,
            "wire": _wire(lambda: compiled(ids, targets)), "tokens": ids.numel(),
            "vocab": vocab, "ids_shape": list(ids.shape)}  # fmt: skip


def hf_padded(family: str, lowering: str | None = None, *, world: int, mesh: Any) -> dict[str, Any]:
    """HF's own loss (shift, ``ignore_index=-100``) on a left-padded batch; logits returned too."""
    import boost_compiler
    from tests.models import make_hf
    from tests.region_checks import _compare

    model, (ids,) = make_hf(seed=0, family=family)
    model.train()
    ref = copy.deepcopy(model)
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids, "use_cache": False})

    def labels_of(step: int) -> torch.Tensor:
        labels = ids.roll(step + 1, dims=1).clone()
        labels[0, :5] = -100  # a left-padded row: its padding is ignored
        return labels

    # lr 0.02: at 0.1 this tiny model amplifies fp32 rounding past 1e-5 in 3 steps even
    # on one device (a twin whose head is two column blocks differs by 1.0e-5).
    run = None
    if lowering is not None:
        run = torch.compile(model, backend="boost", options={"lowering": lowering})
    errs = _compare(model, ref, ids, world, steps=3, labels_of=labels_of, lr=0.02, run=run)
    step = model if run is None else run  # a compiled module has no truth value
    return {**errs, "head": _head(model), "decisions": model.boost_plan.decisions,
            "fallbacks": model.boost_plan.fallbacks,
            "wire": _wire(lambda: step(ids, labels=labels_of(0), use_cache=False).loss),
            "tokens": ids.numel(), "vocab": model.config.vocab_size,
            "ids_shape": list(ids.shape)}  # fmt: skip
