"""Pass ``btp``: bottleneck-aware tensor parallelism (BOOST.md), on a parallelized model.

Invariant: for a graph of a model prepared by ``parallelize`` (its parameter
placeholders carry their placements), the rewritten graph computes, on each
rank, that rank's part of the single-device result, and its outputs are the
full single-device outputs; gradients reaching each local shard are that
shard's part of the single-device gradient. Down factors are row-parallel
(one all-reduce of ``[..., r]`` forward, none backward), up factors column-
parallel (none forward, one all-reduce of ``[..., r]`` backward); everything
between an up factor and the next down factor runs on hidden-dim shards.
On a model that was not parallelized the pass changes nothing.

Setting ``"replicated_head"`` (``options={"btp": "replicated_head"}`` given to
``parallelize``) keeps every LM head whole on each rank instead of splitting it
on the vocabulary: the plan before the vocabulary-parallel head, kept to
measure what that head saves. Setting ``"expert_parallel"`` places every MoE block's
routed experts on ranks, ``E/p`` each, wherever the block allows it
(``tp/rules/expert_parallel.py``); by default the planner weighs that against splitting
each expert's intermediate.
"""

from __future__ import annotations

import torch.fx as fx

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck
from ..tp import rules
from ..tp.apply import apply_plan
from ..tp.collectives import graph_collectives
from ..tp.head_views import split_head_views
from ..tp.placement import Placement
from ..tp.planner import PlanRequest, plan_graph
from ..tp.regions import RegionPlanner
from ..tp.rules.registry import ShardingResult
from .base import BoostPass, PassContext

log = get_logger(__name__)


class BottleneckTP(BoostPass):
    name = "btp"
    allowed = ("replicated_head", "expert_parallel")
    # The rewritten graph calls into these by name: their code is part of the result.
    depends_on = (
        "boost_compiler.tp.planner",
        "boost_compiler.tp.apply",
        "boost_compiler.tp.strategy",
        "boost_compiler.tp.placement",
        "boost_compiler.tp.head_views",
        *rules.MODULES,
        "boost_compiler.tp.sharded_ops",
        "boost_compiler.tp.stretch",
        "boost_compiler.tp.collectives",
    )

    def run(self, graph: fx.Graph) -> None:
        tp = self.ctx.tp
        if tp is None:
            return
        gm = graph.owning_module
        assert gm is not None
        request = PlanRequest(
            self.ctx.param_names,
            tuple(self.ctx.bottlenecks),
            tp.size,
            tp.name,
            tp.rank,
            dict(self.ctx.fixed or {}),
            vocab_parallel=self.setting != "replicated_head",
            expert_parallel=self.setting == "expert_parallel",
            inputs=self.ctx.inputs,
            regions=RegionPlanner(self._plan_body) if self.ctx.run_body is not None else None,
        )
        # Two steps: the rules decide every placement (the graph is unchanged), then the
        # one applier rewrites the graph as planned.
        # Exact on values, and what lets the rules place a fused projection read by heads.
        split_head_views(gm.graph)
        walk = plan_graph(gm.graph, request)
        result = apply_plan(gm, walk)
        self.ctx.notes["btp"] = result
        if result.regions:
            log.info("btp: %d region body(ies) planned: %s", len(result.regions),
                     ", ".join(result.regions))  # fmt: skip
        collectives = graph_collectives(graph)
        fwd = sum(c.forward for c in collectives)
        bwd = sum(c.backward for c in collectives)
        log.info(
            "btp: tp=%d, %d forward / %d backward collective(s), %d fallback(s)",
            tp.size,
            fwd,
            bwd,
            len(result.fallbacks),
        )

    def _plan_body(
        self,
        body: fx.GraphModule,
        param_names: dict[str, str],
        inputs: dict[str, Placement],
        fixed: dict[str, Placement],
    ) -> tuple[ShardingResult, list[Bottleneck]]:
        """The whole pipeline on a region's body, for one layout of its inputs."""
        ctx = PassContext(param_names, tp=self.ctx.tp, fixed=fixed, inputs=inputs)
        self.ctx.run_body(body, ctx)
        result = ctx.notes.get("btp")
        assert isinstance(result, ShardingResult), "the body's pipeline ran without btp"
        return result, list(ctx.bottlenecks)
