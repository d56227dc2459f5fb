"""The plan is the one record of every graph rewritten for a model (issue 26, item 1).

A fallback made while dynamo compiles a later graph (another shape, eval mode, the
user's ``torch.compile``) lands in ``model.boost_plan.fallbacks`` with the graph it came
from, not only in a log line. Structure only: the fake process group, eager lowering.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import boost_compiler
from boost_compiler.models.cola_llama import build, example_inputs
from boost_compiler.tp.groups import fake_process_group
from boost_compiler.tp.rules import registry
from boost_compiler.tp.strategy import RuleContext, Strategy, fallback


def test_a_fallback_forced_in_a_recompile_is_in_the_plan_with_its_graph() -> None:
    torch._dynamo.reset()
    with fake_process_group(2), registry.scope():
        model = build("tiny")
        ids = example_inputs(model.cfg, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, ids)
        plan = model.boost_plan
        assert plan.fallbacks == [] and [g.origin for g in plan.graphs] == ["parallelize"]
        model(*ids)  # the forward's own compile is recorded too, with its collectives
        assert [g.origin for g in plan.graphs] == ["parallelize", "compile"]
        assert plan.graphs[1].collectives == plan.graphs[0].collectives > 0
        assert plan.fallbacks == []

        @registry.rule("mul")  # from now on the SwiGLU product falls back: later graphs only
        def _gather(ctx: RuleContext, node: torch.fx.Node) -> Strategy:
            return fallback()

        model(*example_inputs(model.cfg, seq=8))  # a new shape: dynamo recompiles
        recompiled = plan.graphs[-1]
        assert recompiled.origin == "compile" and recompiled.inputs[0] == "2x8", recompiled
        assert recompiled.fallbacks and all("'mul'" in f for f in recompiled.fallbacks)
        assert plan.fallbacks and all(f.endswith(f"[from {recompiled}]") for f in plan.fallbacks)
        n = len(plan.fallbacks)
        model.eval()
        model(*example_inputs(model.cfg, seq=8))  # eval mode: another graph, same gathers
        assert plan.graphs[-1].fallbacks and len(plan.fallbacks) == n  # each gather once
        assert "graph 2 (compile, inputs 2x8, " in str(plan.fallbacks[0])
