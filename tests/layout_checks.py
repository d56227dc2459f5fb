"""An imported checkpoint of another project's layout, trained at tp=2 against one device
(issue 30, item 1): run by ``tests/test_layouts.py`` through ``tests.tp_harness.run_world``."""

from __future__ import annotations

import copy
from typing import Any

import torch

STEPS, LR = 3, 1e-3  # lr 1e-3: HF-initialised tiny models are chaotic at larger steps (tp_harness)


def train_layout(layout: str, folder: str, *, world: int, mesh: Any) -> dict[str, Any]:
    """``from_pretrained(folder)`` parallelized at tp=``world`` and its single-device copy:
    3 SGD steps on the model's own loss, every logit, loss, gathered gradient and (after
    the last step) gathered parameter compared; the plan's fallbacks and collectives."""
    import boost_compiler
    from tests.region_checks import _compare

    model = boost_compiler.from_pretrained(folder, layout=layout, dtype=torch.float32).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids, "use_cache": False})
    plan = model.boost_plan
    errors = _compare(model, ref, ids, world, steps=STEPS, lr=LR)
    return {
        **errors,
        "fallbacks": list(plan.fallbacks),
        # The factor pairs the planner split as bottlenecks (SLTrain's dense S of the down
        # projection and the next gate/up's, across the residual, may be found as one too).
        "pairs_split": sorted(
            {
                b.down.removesuffix(".down.weight")
                for b in plan.bottlenecks
                if b.down.endswith(".down.weight")
            }
        ),  # fmt: skip
        "bottlenecks": len(plan.bottlenecks),
        "collectives": sorted({(c.kind, tuple(c.global_shape)) for c in plan.collectives}),
    }
