"""Pass ``detect_bottlenecks``: find the low-rank factor pairs and tag them.

Invariant: the graph's computation is unchanged; afterwards ``ctx.bottlenecks``
lists every bottleneck, and its factor nodes carry ``node.meta["boost"] =
{"role": "down" | "up", "bottleneck": i}`` (for drawings and dumps only). Later
passes act only on the factors ``ctx.bottlenecks`` names, so switching this pass
off (``options={"detect_bottlenecks": False}``) makes the backend plain Inductor.
"""

from __future__ import annotations

import torch.fx as fx

from .._logging import get_logger
from ..analysis.bottlenecks import find_bottlenecks
from .base import BoostPass

log = get_logger(__name__)


class DetectBottlenecks(BoostPass):
    name = "detect_bottlenecks"

    def run(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        assert gm is not None, "detect_bottlenecks needs a graph owned by a GraphModule"
        found = find_bottlenecks(gm, self.ctx.param_names)
        nodes = {n.name: n for n in graph.nodes}
        for i, b in enumerate(found):
            nodes[b.down_node].meta["boost"] = {"role": "down", "bottleneck": i}
            nodes[b.up_node].meta["boost"] = {"role": "up", "bottleneck": i}
        self.ctx.bottlenecks = found
        if found:
            log.info(
                "detect_bottlenecks: %d bottleneck(s), ranks %s",
                len(found),
                sorted({b.rank for b in found}),
            )
        else:
            log.info("detect_bottlenecks: no bottleneck found; compiling as plain Inductor")
