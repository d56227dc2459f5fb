"""Factored routed experts (``to_low_rank(..., experts=True)``) at tp=``world`` (issue 30).

One training step of a zoo MoE family whose experts are factored per expert
(:mod:`boost_compiler.convert_experts`) against an untouched single-device copy: the
loss, every gathered gradient, every gathered parameter after an SGD step, on every
rank; the plan's fallbacks, the experts' placements, and the functional collectives the rank
executed (forward and backward).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.moe_checks import ran_in
from tests.mutation_checks import _gather, _rel
from tests.zoo_checks import VOCAB, build

RANK = 16  # per expert: below min(2I, H) = 64 and min(H, I) = 32 of the zoo's experts


def factored(family: str, method: str) -> torch.nn.Module:
    """The zoo's ``family`` with its routed experts factored too, at :data:`RANK`."""
    import boost_compiler

    model = build(family)
    torch.manual_seed(0)
    boost_compiler.to_low_rank(model, method=method, rank=RANK, include="*.experts",
                               experts=True)  # fmt: skip
    return model


def factored_step(
    family: str, method: str, *, world: int, mesh: Any, lr: float = 1e-3
) -> dict[str, Any]:
    """One step of :func:`factored` at tp=``world`` against one device."""
    import boost_compiler

    model = factored(family, method)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = {"labels": ids.roll(1, dims=1), "use_cache": False}
    boost_compiler.parallelize(model, mesh, (ids,), kw)
    plan = model.boost_plan
    out, forward = ran_in(lambda: model(ids, **kw))
    loss, loss_ref = out.loss, ref(ids, **kw).loss
    _, backward = ran_in(loss.backward)
    loss_ref.backward()
    pairs = list(zip(model.named_parameters(), ref.parameters(), strict=True))
    grad = {n: _rel(_gather(p.grad, plan.params[n], world), q.grad) for (n, p), q in pairs}
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=lr).step()
    param = max(_rel(_gather(p.detach(), plan.params[n], world), q.detach()) for (n, p), q in pairs)
    return {
        "loss": _rel(loss.detach(), loss_ref.detach()),
        "grad": max(grad.values()),
        "expert_grads": {n: e for n, e in grad.items() if ".experts." in n},
        "param": param,
        "fallbacks": list(plan.fallbacks),
        "experts": {n: str(pl) for n, pl in plan.params.items() if ".experts." in n},
        "ran": {"forward": forward, "backward": backward},
    }
