"""Pass ``online_norm``: a norm's statistics travel in the down factors' all-reduce.

Invariant: same values and gradients; a norm on a hidden shard whose every
consumer is a row-parallel down factor no longer has a collective of its own.
The factors run on the un-normalised, weight-scaled shard, and ONE all-reduce
carries ``[partial latents..., local statistics]``; the per-token scale
(and for LayerNorm the mean correction) is applied after it
(:func:`~boost_compiler.tp.sharded_ops.online_rms_norm_reduce`,
:func:`~boost_compiler.tp.sharded_ops.online_layer_norm_reduce`; BOOST.md, "online norm").

Backward: the fused all-reduce is Megatron's g (its consumers are replicated),
so its backward is the identity, and every other op of the rewrite is local:
no norm collective remains in the backward either. The structure test counts
this on Inductor's backward graph rather than assuming it.

Only under ``btp``: on one process there is no collective to merge, and the
single-device norm is already one fused kernel, so the pass does nothing.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .._logging import get_logger
from ..tp import sharded_ops as tp_ops
from ._rewrite import finish, reduce_of, weight_arg
from .base import BoostPass

log = get_logger(__name__)

_NORMS = (tp_ops.sharded_rms_norm, tp_ops.sharded_layer_norm)


class OnlineNorm(BoostPass):
    name = "online_norm"
    depends_on = ("boost_compiler.passes._rewrite", "boost_compiler.tp.sharded_ops")

    def run(self, graph: fx.Graph) -> None:
        if self.ctx.tp is None:
            return
        gm = graph.owning_module
        assert gm is not None
        fused = 0
        for norm in [n for n in graph.nodes if n.op == "call_function" and n.target in _NORMS]:
            downs = list(norm.users)
            if not downs or not all(_is_partial_of(d, norm) for d in downs):
                log.debug(
                    "online_norm: %s keeps its own statistics all-reduce: consumers %s are "
                    "not all row-parallel down factors",
                    norm.name,
                    [d.name for d in downs],
                )
                continue
            fused += _fuse(graph, norm, downs)
        if fused:
            finish(gm)
        log.info("online_norm: %d norm(s) merged into their down factors' all-reduce", fused)


def _is_partial_of(node: fx.Node, norm: fx.Node) -> bool:
    return weight_arg(node) is not None and node.args[0] is norm and reduce_of(node) is not None


def _fuse(graph: fx.Graph, norm: fx.Node, downs: list[fx.Node]) -> bool:
    """One all-reduce for the downs' partials and the norm's statistics; False: kept."""
    rms = norm.target is tp_ops.sharded_rms_norm
    if rms:
        x, w, eps, d, group = norm.args
        b = None
    else:
        x, w, b, eps, d, group = norm.args
        if w is None:
            return False  # no weight: w @ A would need a ones vector; rare, keep it simple
    reduces = [reduce_of(n) for n in downs]
    with graph.inserting_before(downs[0]):
        xw = graph.call_function(operator.mul, (x, w)) if w is not None else x
    for n in downs:
        n.replace_input_with(norm, xw)
    anchor = max(downs, key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_after(anchor):
        if rms:
            fused = graph.call_function(tp_ops.online_rms_norm_reduce, (downs, x, eps, d, group))
        else:
            w_parts = [graph.node_copy(n, lambda a, n=n: w if a is xw else a) for n in downs]
            b_parts = (
                [graph.node_copy(n, lambda a, n=n: b if a is xw else a) for n in downs]
                if b is not None
                else None
            )
            fused = graph.call_function(
                tp_ops.online_layer_norm_reduce, (downs, w_parts, b_parts, x, eps, d, group)
            )
    for i, r in enumerate(reduces):
        with graph.inserting_after(fused):
            piece = graph.call_function(operator.getitem, (fused, i))
        r.replace_all_uses_with(piece)
        graph.erase_node(r)
    graph.erase_node(norm)
    return True
