"""Passes over Inductor's post-grad graphs (forward and backward), after the boost pipeline.

The boost passes rewrite dynamo's forward graph; AOTAutograd then derives the backward,
and only at Inductor's post-grad stage do both graphs exist with their collectives. What
must see those lives here: how a rank waits for a collective (:mod:`.poll_waits`) and
what runs while it is in flight (:mod:`.overlap`).
"""

import hashlib
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomSchedulerPass

from .overlap import reorder
from .poll_waits import STARTS, WAIT, WAITS, polls, split_collectives

# folded into Inductor's cache key: a change to these passes recompiles
SOURCE_DIGEST = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
).hexdigest()[:16]


def post_grad(graph: fx.Graph, wait: str, overlap: bool) -> int:
    """Options ``collective_wait`` and ``overlap_comm`` on one post-grad graph: how many
    collectives were split into start and wait. Without overlap only the polled ones are:
    a collective waited for by blocking stays torch's own (``wait_tensor``), which
    Inductor lowers itself (on NCCL, a stream dependency; with ``symm_mem_all_reduce``,
    a one-shot all-reduce)."""
    if wait == "block" and not overlap:
        return 0
    return split_collectives(graph, wait, split_blocking=overlap)


class OverlapSchedule(CustomSchedulerPass):
    """:func:`.overlap.reorder` as Inductor's ``_post_fusion_custom_pass`` (cacheable)."""

    def __call__(self, nodes: list) -> list:  # type: ignore[type-arg]
        return reorder(nodes)

    def uuid(self) -> str:
        return SOURCE_DIGEST


__all__ = [
    "SOURCE_DIGEST", "STARTS", "WAIT", "WAITS", "OverlapSchedule", "polls", "post_grad", "reorder",
    "split_collectives",
]  # fmt: skip
