"""Pass ``inline_regions``: the user's checkpoint regions inlined, their recompute kept as tags.

Invariant: afterwards the graph holds no ``tag_activation_checkpoint``
higher-order op (what dynamo makes of ``torch.utils.checkpoint``, and so of
Hugging Face's ``gradient_checkpointing_enable()``); the region's ops sit in
the graph itself, each tagged ``node.meta["recompute"] = PREFER_RECOMPUTE``
with one ``ac_graph_id`` per region. That is the annotation torch's own
lowering of the op produces, and AOTAutograd's partitioner honours it the
same way (TORCH_NOTES), so the checkpointing is kept under Inductor while
detection and the sharding rules see the region's ops like any others
(a bottleneck inside a region is found and parallelized). On a parallelized
model the regions are inlined without the tags for now (see ``run``). Values
are unchanged; a graph run without Inductor (``lowering="eager"``) computes
the same numbers without recomputing anything.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .._logging import get_logger
from ..ir.subgraphs import drop_unused_bodies, inline_call
from .base import BoostPass

log = get_logger(__name__)

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
# Region ids well above the ones the ``checkpoint`` pass numbers its regions with.
_FIRST_ID = 1 << 20


class InlineRegions(BoostPass):
    name = "inline_regions"

    def run(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        assert gm is not None, "inline_regions needs a graph owned by a GraphModule"
        ids = itertools.count(_FIRST_ID)
        # Under tensor parallelism the regions are inlined without recompute tags: with
        # them, Inductor's partitioner recomputed a region's row-parallel factor into a
        # wrong weight gradient (found by the fuzzer: a checkpointed bottleneck, tp=2).
        # Exact either way; such a region then keeps its activations (more memory) until
        # the tags are cut at the collectives the way the ``checkpoint`` pass cuts them.
        tagged = self.ctx.tp is None
        found = False
        while hops := [n for n in graph.nodes if n.target is _CHECKPOINT]:
            found = True
            for hop in hops:  # a region inside a region surfaces on the next round
                _inline(gm, hop, next(ids) if tagged else None)
        if found and not tagged:
            log.warning(
                "inline_regions: torch.utils.checkpoint regions of a parallelized model run "
                "exactly but are not recomputed yet (their activations are kept); "
                "options={'checkpoint': True} gives BOOST's communication-free checkpointing"
            )
        # Only the bodies' get_attr nodes go: a general dead-code sweep would also
        # drop the in-place ops (no users) that ``functionalize`` still has to see.
        drop_unused_bodies(gm)


def _inline(gm: fx.GraphModule, hop: fx.Node, region: int | None) -> None:
    def tag(node: fx.Node) -> None:
        node.meta.setdefault("recompute", CheckpointPolicy.PREFER_RECOMPUTE)
        node.meta.setdefault("ac_graph_id", region)

    inline_call(gm, hop, first_operand=1, tag=tag if region is not None else None)
