"""Checks of tests/test_planner.py, run on every rank of one 2-process gloo world.

The hybrid model of ``benchmarks/hybrid_mlp.py`` (low-rank CoLA attention, dense SwiGLU
MLP) and the dense twin of the CoLA-LLaMA, small: parallelized, trained 3 SGD steps
against one device, then one more step profiled, whose gloo events (logical bytes, as
the benchmarks count them) are compared with what the planner predicted for the graph
that ran, and whose functional collectives (op and payload, forward and backward apart)
are returned as ``ran``. ``compiled``: through ``torch.compile(model, backend="boost")`` (Inductor).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests import tp_harness as H

SPEC = dict(d=64, ff=176, rank=16, layers=2, heads=4, vocab=256, batch=2, seq=16)


def _model(kind: str) -> torch.nn.Module:
    from benchmarks.hybrid_mlp import make_hybrid
    from boost_compiler.bench.harness import ModelSpec, make_model

    spec = ModelSpec(**SPEC)
    return make_hybrid(spec) if kind == "hybrid" else make_model("boost-dense", spec)


def planned(kind: str, *, world: int, mesh: Any, compiled: bool = False) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    import boost_compiler
    from boost_compiler.bench.harness import BACKWARD_MARK, count_collectives
    from tests.moe_checks import _collectives

    model = _model(kind)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, SPEC["vocab"], (SPEC["batch"], SPEC["seq"]),
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})
    run = torch.compile(model, backend="boost") if compiled else model

    def step(m: torch.nn.Module) -> Any:
        return (run if m is model else m)(ids, labels=ids)

    res = H._training_result(model, ref, step, world=world, steps=3, lr=0.1, loss_of=H.probe_loss)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = step(model)
        with record_function(BACKWARD_MARK):
            loss.backward()
    sent = count_collectives(prof, world)
    events = prof.events()
    bwd_start = min(e.time_range.start for e in events if e.name == BACKWARD_MARK)
    ran = {  # the functional collectives this rank executed, each direction apart
        "forward": _collectives(e for e in events if e.time_range.start < bwd_start),
        "backward": _collectives(e for e in events if e.time_range.start >= bwd_start),
    }
    plan = model.boost_plan
    return {
        "loss_err": res["loss_err"], "grad_err": res["grad_err"], "param_err": res["param_err"],
        "fallbacks": list(plan.fallbacks),
        "sent_bytes": sent["bytes"], "sent": sent["count"],
        "predicted_bytes": plan.graphs[-1].predicted_bytes,
        "choices": [(c.where, c.chosen, sorted(c.seconds)) for c in plan.choices],
        "sharded": sorted(n for n, pl in plan.params.items() if pl.is_shard),
        "ran": ran,
    }  # fmt: skip
