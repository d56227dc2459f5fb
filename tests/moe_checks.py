"""MoE experts in parallel (issue 30, item 2): what each rank computes of the routed experts.

One training step of a zoo MoE family (:mod:`tests.zoo_checks`) at tp=``world``
against an untouched single-device copy: the FLOPs of the GEMMs that ran (each
``aten::mm``/``addmm``/``bmm`` the profiler recorded, priced by
``torch.utils.flop_counter``'s formulas from its shapes), those inside the experts'
grouped GEMMs apart (``transformers``' ``grouped_mm_fallback`` and its backward in the
boost graph, ``torch._grouped_mm`` in the eager reference: both run one ``mm`` per
expert); the loss, every gathered gradient and every gathered parameter after one SGD
step; the experts' planned placements; the functional collectives the rank executed in
the step, forward and backward apart (op and payload shape: what ran, not the plan's
record of it). ``FlopCounterMode`` itself cannot watch a parallelized model: under a
``TorchDispatchMode`` dynamo runs the forward frame uncompiled, and the placeholders
refuse that (``UncompiledFrameError``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils import flop_counter

from tests.mutation_checks import _gather, _rel
from tests.tp_harness import _norm_rel
from tests.zoo_checks import VOCAB, build

# The experts' grouped GEMM kernels; the matmuls under them are expert FLOPs.
EXPERT_OPS = frozenset({
    "transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward",
    "aten::_grouped_mm",
})  # fmt: skip
_FORMULAS = {"aten::mm": flop_counter.mm_flop, "aten::addmm": flop_counter.addmm_flop,
             "aten::bmm": flop_counter.bmm_flop}  # fmt: skip


def _in_experts(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in EXPERT_OPS:
            return True
        parent = parent.cpu_parent
    return False


def _collectives(events: Any) -> list[list[Any]]:
    """The functional collectives among profiled ``events``, in order: [op, input shape].

    What the rank executed (op and payload as the op received it: a reduce-scatter's
    input with the scattered dimension first, an all-gather's local shard), where gloo's
    own events cannot tell a reduce-scatter from an all-reduce, which gloo runs it as.
    """
    ran = sorted((e for e in events if e.name.startswith("_c10d_functional::")
                  and "wait_tensor" not in e.name), key=lambda e: e.time_range.start)  # fmt: skip
    return [[e.name.split("::")[1], list(e.input_shapes[0])] for e in ran]


def _step(run: Any, ids: torch.Tensor) -> tuple[torch.Tensor, int, int, dict[str, list]]:
    """One forward + backward: loss, expert GEMM FLOPs, all GEMM FLOPs, and the functional
    collectives each direction executed (:func:`_collectives`)."""
    from torch.profiler import ProfilerActivity, profile

    phases = {}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = run(ids, labels=ids.roll(1, dims=1), use_cache=False)
    phases["forward"] = prof.events()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.loss.backward()
    phases["backward"] = prof.events()
    experts = total = 0
    for events in phases.values():
        for e in events:
            if e.name in _FORMULAS:
                flops = _FORMULAS[e.name](*e.input_shapes[: 3 if e.name == "aten::addmm" else 2])
                total += flops
                experts += flops if _in_experts(e) else 0
    ran = {phase: _collectives(events) for phase, events in phases.items()}
    return out.loss.detach(), experts, total, ran


def experts_step(
    family: str,
    *,
    world: int,
    mesh: Any,
    lr: float = 1e-3,
    options: dict | None = None,
    overrides: dict | None = None,
    compiled: bool = False,
) -> dict[str, Any]:
    """:func:`_step` of ``family`` at tp=``world`` and on one device, compared; ``options``
    go to ``parallelize``, ``overrides`` to the config; ``compiled``: the step through
    ``torch.compile(model, backend="boost", options=options)`` (Inductor). ``held``: for each expert weight, which of one device's experts
    this rank's local tensor equals (its first dim), read off the tensors."""
    import boost_compiler

    model = build(family, **(overrides or {}))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    boost_compiler.parallelize(
        model, mesh, (ids,), {"labels": ids, "use_cache": False}, options=options
    )
    plan = model.boost_plan
    whole = dict(ref.named_parameters())
    held = {
        n: [e for e, w in enumerate(whole[n]) if any(torch.equal(w, mine) for mine in p)]
        for n, p in model.named_parameters()
        if ".experts." in n
    }
    run = torch.compile(model, backend="boost", options=options) if compiled else model
    run(ids, labels=ids, use_cache=False).loss.backward()  # compiled here, not counted
    model.zero_grad()
    loss, experts, total, ran = _step(run, ids)
    loss_ref, experts_ref, total_ref, _ = _step(ref, ids)
    grad = max(
        _rel(_gather(p.grad, plan.params[n], world), q.grad)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    )
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=lr).step()
    param = max(
        _rel(_gather(p.detach(), plan.params[n], world), q.detach())
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    )
    # read off the model, not the plan: gate_up_proj and down_proj per MoE layer
    layers = sum(".experts." in n for n, _ in model.named_parameters()) // 2
    return {
        "loss": _rel(loss, loss_ref),
        "grad": grad,
        "param": param,
        "fallbacks": list(plan.fallbacks),
        "experts": {n: str(pl) for n, pl in plan.params.items() if ".experts." in n},
        "held": held,
        "decisions": [d for d in plan.decisions if "expert-parallel" in d],
        "expert_flops": experts,
        "expert_flops_ref": experts_ref,
        "expert_ratio": experts / experts_ref,
        "gemm_ratio": total / total_ref,
        "moe_layers": layers,
        "ran": ran,
    }


def ran_in(fn: Any) -> tuple[Any, list[list[Any]]]:
    """``fn()`` and the functional collectives it executed (:func:`_collectives`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = fn()
    return out, _collectives(prof.events())


INNER = 8  # the probe's expert intermediate


class ExpertsProbe(torch.nn.Module):
    """A MoE block of the ``transformers`` kernel's form on a hidden shard, to reach both
    splits of the grouped GEMM rule (``tp/rules/experts.py``).

    ``routed``: a dense router reads the hidden, which the plan gathers; the dispatch
    indexes that copy, so the up GEMM is column-parallel and the down GEMM row-parallel
    (the zoo's plan). Without it the routing is fixed by the token ids and the dispatch
    picks rows of the hidden shard: the up GEMM is row-parallel (its weight split on the
    hidden), the down GEMM column-parallel (the fine-grained expert as a bottleneck).
    """

    D, R, E, K = 16, 8, 4, 2

    def __init__(self, routed: bool, inner: int = INNER) -> None:
        super().__init__()
        d, e, i = self.D, self.E, inner
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.down = torch.nn.Linear(d, self.R, bias=False)
        self.up = torch.nn.Linear(self.R, d, bias=False)
        self.router = torch.nn.Linear(d, e, bias=False) if routed else None
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, d) / d**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(e, d, i) / i**0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import transformers.integrations.moe  # noqa: F401 (registers grouped_mm_fallback)

        grouped = torch.ops.transformers.grouped_mm_fallback
        h = self.emb(ids)
        h = h + self.up(torch.nn.functional.silu(self.down(h)))  # a hidden shard
        x = h.reshape(-1, self.D)
        if self.router is not None:
            weights, picked = self.router(x).softmax(-1).topk(self.K, dim=-1)
        else:
            flat = ids.reshape(-1, 1)
            picked = torch.cat([flat % self.E, (flat + 1) % self.E], dim=-1)
            weights = torch.full(picked.shape, 0.5) + flat / (2 * VOCAB)
        expert_ids, perm = torch.sort(picked.reshape(-1))
        rows = x[perm // self.K]
        counts = torch.histc(expert_ids.float(), bins=self.E, min=0, max=self.E - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = grouped(rows, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, -1)
        out = grouped(torch.nn.functional.silu(gate) * up, self.down_proj.transpose(-2, -1),
                      offs=offs)  # fmt: skip
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        out = out[torch.argsort(perm)].view(-1, self.K, self.D).sum(dim=1)
        return h + out.view(h.shape)


def experts_probe(routed: bool, *, world: int, mesh: Any, inner: int = INNER) -> dict[str, Any]:
    """:class:`ExpertsProbe` at tp=``world`` against one device: output, every gradient,
    the experts' placements, the plan's expert-parallel decisions."""
    import boost_compiler

    torch.manual_seed(0)
    model = ExpertsProbe(routed, inner)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    boost_compiler.parallelize(model, mesh, (ids,))
    plan = model.boost_plan
    fixed = torch.randn(2, 8, ExpertsProbe.D, generator=torch.Generator().manual_seed(3))
    out, forward = ran_in(lambda: model(ids))
    _, backward = ran_in((out * fixed).sum().backward)
    out_ref = ref(ids)
    (out_ref * fixed).sum().backward()
    grad = max(
        _rel(_gather(p.grad, plan.params[n], world), q.grad)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    )
    return {
        "out": _rel(out.detach(), out_ref.detach()),
        "grad": grad,
        "fallbacks": list(plan.fallbacks),
        "params": {n: str(pl) for n, pl in plan.params.items()},
        "ran": {"forward": forward, "backward": backward},
        "decisions": [d for d in plan.decisions if "expert-parallel" in d],
    }


# bf16's unit roundoff: one rounding moves a value by up to 2^-8 of itself.
BF16_U = 2.0**-8


def _routing(out: Any, k: int) -> list[list[list[int]]]:
    """Each MoE layer's chosen experts per token, as sets (sorted): order within the top-k
    is a near-tie the combine does not see."""
    return [lg.float().topk(k, dim=-1).indices.sort(-1).values.tolist() for lg in out.router_logits]


def _margin(out: Any, k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logit, over all layers."""
    gaps = [lg.float().topk(k + 1, dim=-1).values for lg in out.router_logits]
    return min(float((v[:, k - 1] - v[:, k]).min()) for v in gaps)


def experts_bf16_step(*, world: int, mesh: Any, family: str = "qwen3_moe") -> dict[str, Any]:
    """One bf16 forward + backward at tp=``world`` against one device in bf16 and in fp32.

    Returned, per compared quantity (logits, loss, every gathered gradient, the loss after
    one SGD step): its error against fp32 at tp=``world`` (``tp``) and on one device in
    bf16 (``one``), each relative to the fp32 tensor's own norm (:func:`_norm_rel`: a
    tensor's largest element would let a wrong small part hide), and each
    MoE layer's routing in all three runs. The batch is the one of 8 whose smallest
    top-k router margin (fp32) is largest: bf16 moves the router's input by about 1e-2
    of itself, and a near-tie routed differently moves an expert's gradient by O(1).
    """
    import boost_compiler

    model32 = build(family)
    k = model32.config.num_experts_per_tok
    kw = {"use_cache": False, "output_router_logits": True}
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(s))
               for s in range(1, 9)]  # fmt: skip
    with torch.no_grad():
        ids = max(batches, key=lambda b: _margin(model32(b, **kw), k))
    kw["labels"] = ids.roll(1, dims=1)
    one = copy.deepcopy(model32).to(torch.bfloat16)
    model = copy.deepcopy(one)
    boost_compiler.parallelize(model, mesh, (ids,), kw)
    plan = model.boost_plan
    outs = {name: m(ids, **kw) for name, m in (("tp", model), ("one", one), ("fp32", model32))}
    for out in outs.values():
        out.loss.backward()
    ref = outs["fp32"]
    errs: dict[str, dict[str, float]] = {"tp": {}, "one": {}}
    for run in ("tp", "one"):
        errs[run]["logits"] = _norm_rel(outs[run].logits, ref.logits)
        errs[run]["loss"] = _norm_rel(outs[run].loss, ref.loss)
    for (n, p), q, q32 in zip(model.named_parameters(), one.parameters(), model32.parameters(),
                              strict=True):  # fmt: skip
        errs["tp"][n] = _norm_rel(_gather(p.grad, plan.params[n], world), q32.grad)
        errs["one"][n] = _norm_rel(q.grad, q32.grad)
    routing = {name: _routing(out, k) for name, out in outs.items()}
    # One SGD step each, then the loss again: the parallel model trains on its shards.
    for m in (model, one, model32):
        torch.optim.SGD(m.parameters(), lr=1e-2).step()
    after = {name: m(ids, **kw).loss.float() for name, m in
             (("tp", model), ("one", one), ("fp32", model32))}  # fmt: skip
    for run in ("tp", "one"):
        errs[run]["loss_after_step"] = _norm_rel(after[run], after["fp32"])
    return {
        **errs,
        "margin": _margin(ref, k),
        "routing": routing,
        "fallbacks": list(plan.fallbacks),
        "experts": {n: str(pl) for n, pl in plan.params.items() if ".experts." in n},
    }
