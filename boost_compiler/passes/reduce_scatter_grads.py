"""Pass ``reduce_scatter_grads``: a gathered value that only feeds rank-varying work
sends its gradient back with a reduce-scatter.

Invariant: same values and gradients. ``btp`` writes the input of a column-split
consumer of the full hidden (the vocabulary-parallel head) as
``copy_to_tp(gather_from_tp(x))``: forward all-gather, backward an all-reduce of
the full ``[.., d]`` gradient (f) and then this rank's slice of it (the gather).
When that f is the gather's only consumer, the gradient arriving at the gather
is only ever sliced, so the pair becomes one
:func:`~boost_compiler.tp.collectives.gather_sum_grad`: the backward is a
reduce-scatter, which moves half an all-reduce's bytes (ring algorithms:
``(p-1)/p`` against ``2(p-1)/p`` of the payload). A gather with any replicated
consumer keeps the pair: that consumer's gradient is already whole, and a
reduce-scatter would sum it ``p`` times.

Only under ``btp``; the forward graph's collectives are unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from .._logging import get_logger
from ..tp import collectives as C
from ._rewrite import is_copy
from .base import BoostPass

log = get_logger(__name__)


class ReduceScatterGrads(BoostPass):
    name = "reduce_scatter_grads"
    depends_on = ("boost_compiler.passes._rewrite", "boost_compiler.tp.collectives")

    def run(self, graph: fx.Graph) -> None:
        if self.ctx.tp is None:
            return
        fused = 0
        for gather in [n for n in graph.nodes if _is_gather(n)]:
            users = list(gather.users)
            if not users or not all(is_copy(u) for u in users):
                continue
            with graph.inserting_after(gather):
                new = graph.call_function(C.gather_sum_grad, gather.args, gather.kwargs)
            new.meta.update(gather.meta)
            for f in users:
                f.replace_all_uses_with(new)
                graph.erase_node(f)
            graph.erase_node(gather)
            fused += 1
        log.info("reduce_scatter_grads: %d gather(s) send their gradient by reduce-scatter", fused)


def _is_gather(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is C.gather_from_tp
