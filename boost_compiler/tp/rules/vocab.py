"""Vocabulary-parallel LM head and cross-entropy rules of the sharding propagator.

A low-rank body is cheap, so a dense head ``d -> V`` replicated on every rank
is a large share of each rank's step (BOOST.md, "The head and the loss"). When
the head's logits reach ``F.cross_entropy`` in the graph, the head is split on
the vocabulary instead: each rank computes ``[.., V/p]`` logits from the full
hidden, the views in between (HF's shift, ``.float()``, ``.view(-1, V)``) keep
the vocabulary shard, and the loss is :func:`tp_ops.vocab_parallel_cross_entropy`
(per-token statistics only; no ``[.., V]`` collective in either direction).
Where the logits also leave the graph (HF returns them with the loss), they
are all-gathered once at the output, which this module weighs against the
replicated head before choosing; the choice and its reason go into the plan.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import Contraction, shape_of, value_of
from .. import kernels as tp_ops
from ..placement import R, S

if TYPE_CHECKING:
    from ..propagate import ShardingPropagator as _Host
else:
    _Host = object

_LOSS_SIGNATURE = inspect.signature(F.cross_entropy)
# FLOPs a device does per byte a collective moves: above this, computing the head
# once per rank costs more than all-gathering its logits. Rough machine balances
# (accelerator: ~1e15 FLOP/s against ~4.5e11 B/s NVLink; CPU + gloo: ~5e10 / 2e9).
_BALANCE = {"cuda": 2000.0, "cpu": 25.0}


class VocabRules(_Host):
    """Mixed into the propagator next to :class:`~boost_compiler.tp.rules.core.OpRules`."""

    def _vocab_parallel_head(self, node: fx.Node, c: Contraction) -> bool:
        """Split a dense head on its output (vocabulary) dim if its logits reach a loss.

        The decision is made once, by ``parallelize`` (the weight is undecided);
        a graph compiled later for the same model finds the weight already split
        on the vocabulary and follows it, whatever the call computes.
        """
        vocab_dim = 0 if c.weight_layout == "out_in" else 1
        if c.weight not in self.undecided:
            return self.env.get(c.weight) == S(vocab_dim) and self._split_head(node, c, "")
        if c.d_out % self.p:
            return False  # V does not divide: the head stays whole
        loss, leaves = _logit_uses(node)
        if not loss:
            return False
        name = self.param_names[c.weight.name]
        if leaves:
            elem = value_of(node).element_size()
            device = value_of(node).device.type
            per_byte = 6 * c.d_in / elem  # head FLOPs saved per logit byte gathered
            balance = _BALANCE.get(device, _BALANCE["cuda"])
            if per_byte < balance:
                self.result.decisions.append(
                    f"{name}: replicated head: the logits leave the graph, and gathering "
                    f"them costs more than the head ({per_byte:.0f} < {balance:.0f} FLOP/B)"
                )
                return False
        why = "its logits reach a cross-entropy"
        if leaves:
            why += " (and leave the graph: gathered once at the output)"
        return self._split_head(node, c, f"{name}: vocabulary-parallel head, {why}")

    def _split_head(self, node: fx.Node, c: Contraction, decision: str) -> bool:
        node.replace_input_with(c.input, self.to_replicate(c.input, node, "vocab head"))
        self._decide(c.weight, S(0 if c.weight_layout == "out_in" else 1))
        if c.bias is not None:
            self._decide(c.bias, S(0))
        self.set(node, S(len(shape_of(node)) - 1))
        if decision:
            self.result.decisions.append(decision)
        return True

    def _cross_entropy(self, node: fx.Node) -> None:
        """``F.cross_entropy`` of vocabulary-sharded ``[N, V/p]`` logits: per-token statistics."""
        args = _LOSS_SIGNATURE.bind(*node.args, **node.kwargs).arguments
        x, target = args["input"], args["target"]
        pl = self.placement(x)
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        t = value_of(target)
        plain = all(args.get(k) is None for k in ("weight", "size_average", "reduce"))
        if (
            len(shape_of(x)) != 2 or pl.dim != 1 or pl.blocks or not plain
            or not isinstance(t, torch.Tensor) or t.is_floating_point()
        ):  # fmt: skip
            return self._fallback(node)
        target = self.to_replicate(target, node)
        vocab = shape_of(x)[1]
        node.target = tp_ops.vocab_parallel_cross_entropy
        node.args = (
            x, target, args.get("ignore_index", -100), args.get("reduction", "mean"),
            float(args.get("label_smoothing", 0.0)), vocab, self.rank, self.p, self.group,
        )  # fmt: skip
        node.kwargs = {}
        n = shape_of(x)[0]
        stats = 3 if node.args[4] else 2
        self._record("all_reduce", node, x, fwd=True, bwd=False, reason="loss max")
        self.result.collectives[-1].global_shape = (n,)
        self._record("all_reduce", node, x, fwd=True, bwd=False, reason="loss statistics")
        self.result.collectives[-1].global_shape = (n, stats)
        self.result.collectives[-1].dtype = torch.float32
        self.env[node] = R


def _logit_uses(head: fx.Node, depth: int = 16) -> tuple[bool, bool]:
    """(reaches ``F.cross_entropy`` as its input, reaches the graph output) from ``head``."""
    loss = leaves = False
    seen: set[fx.Node] = set()
    frontier = [(head, 0)]
    while frontier:
        node, d = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                leaves = True
            elif user.target is F.cross_entropy:
                loss = loss or (user.args and user.args[0] is node)
            elif d < depth:
                frontier.append((user, d + 1))
    return bool(loss), leaves
