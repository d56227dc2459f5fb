"""Vocabulary-parallel LM head and cross-entropy rules of the sharding planner.

A low-rank body is cheap, so a dense head ``d -> V`` replicated on every rank
is a large share of each rank's step (BOOST.md, "The head and the loss"). When
the head's logits reach ``F.cross_entropy`` in the graph, the head is split on
the vocabulary instead: each rank computes ``[.., V/p]`` logits from the full
hidden, the views in between (HF's shift, ``.float()``, ``.view(-1, V)``) keep
the vocabulary shard, and the loss is :func:`tp_ops.vocab_parallel_cross_entropy`
(an online softmax: one all-gather of ``[N, 2]`` per-token statistics forward, no
collective backward, no ``[.., V]`` collective in either direction).
Where the logits also leave the graph (HF returns them with the loss), they
are all-gathered once at the output, which this module weighs against the
replicated head before choosing; the choice and its reason go into the plan.
(The head is a contraction: ``matrix`` asks :func:`vocab_parallel_head` before
running a dense head replicated.) A weight tied between the embedding and the
head is split on the vocabulary for both (:func:`tied_vocab_split`): the
lookup is a partial sum that one reduce-scatter puts onto the hidden shards,
and the head is the vocabulary-parallel one above, so no ``[.., V]`` partial
logits are all-reduced.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.op_table import op_kind
from ...ir.ops import (
    Contraction,
    as_contraction,
    is_elementwise_on_last_dim,
    last_dim,
    shape_of,
    value_of,
)
from .. import plan_cost as cost
from .. import sharded_ops as tp_ops
from ..placement import P, R, S
from ..strategy import Call, RuleContext, Strategy, Then, fallback
from .core import call_replicated
from .registry import rule

_LOSS_SIGNATURE = inspect.signature(F.cross_entropy)
_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)
# FLOPs a device does per byte a collective moves: above this, computing the head
# once per rank costs more than all-gathering its logits. Rough machine balances
# (accelerator: ~1e15 FLOP/s against ~4.5e11 B/s NVLink; CPU + gloo: ~5e10 / 2e9).
_BALANCE = {"cuda": 2000.0, "cpu": 25.0}


def vocab_parallel_head(ctx: RuleContext, node: fx.Node, c: Contraction) -> Strategy | None:
    """Split a dense head on its output (vocabulary) dim if its logits reach a loss.

    The decision is made once, by ``parallelize`` (the weight is open); a graph
    compiled later for the same model finds the weight already split on the
    vocabulary and follows it, whatever the call computes. None: not such a head.
    """
    vocab_dim = 0 if c.weight_layout == "out_in" else 1
    if not ctx.is_open(c.weight):
        return _split_head(ctx, node, c, "") if ctx.placement(c.weight) == S(vocab_dim) else None
    if c.d_out % ctx.p or not ctx.vocab_parallel:
        return None  # V does not divide (or the option says so): the head stays whole
    loss, leaves = _logit_uses(node)
    if not loss:
        return None
    name = ctx.param_name(c.weight)
    head = _reaches_loss_as_logits(node)
    if leaves and head:
        elem = value_of(node).element_size()
        device = value_of(node).device.type
        per_byte = 6 * c.d_in / elem  # head FLOPs saved per logit byte gathered
        balance = _BALANCE.get(device, _BALANCE["cuda"])
        if per_byte < balance:
            whole = Strategy(out=R, whole=True)
            whole.note = (
                f"{name}: replicated head: the logits leave the graph, and gathering "
                f"them costs more than the head ({per_byte:.0f} < {balance:.0f} FLOP/B)"
            )
            return whole
    if not head:
        # Split the same way (exact), but it is no head: say what it is, not "vocabulary".
        return _split_head(ctx, node, c, f"{name}: column-parallel (its {c.d_out} outputs "
                           "split): its output reaches a cross-entropy through later layers")  # fmt: skip
    why = "its logits reach a cross-entropy"
    if leaves:
        why += " (and leave the graph: gathered once at the output)"
    return _split_head(ctx, node, c, f"{name}: vocabulary-parallel head, {why}")


def _split_head(ctx: RuleContext, node: fx.Node, c: Contraction, decision: str) -> Strategy:
    s = Strategy(out=S(len(shape_of(node)) - 1), note=decision)
    s.read(c.input, R, "vocab head")
    if ctx.is_open(c.weight):
        s.fix[c.weight] = S(0 if c.weight_layout == "out_in" else 1)
    if c.bias is not None:
        if ctx.is_open(c.bias):
            s.fix[c.bias] = S(0)
        elif ctx.placement(c.bias) != S(0):
            # A bias fixed otherwise (a forced plan): this rank's slice of the whole bias.
            s.read(c.bias, S(0))
    return s


@rule("cross_entropy")
def cross_entropy(ctx: RuleContext, node: fx.Node) -> Strategy:
    """``F.cross_entropy`` of vocabulary-sharded ``[N, V/p]`` logits: per-token statistics."""
    args = _LOSS_SIGNATURE.bind(*node.args, **node.kwargs).arguments
    x, target = args["input"], args["target"]
    pl = ctx.placement(x)
    if not pl.is_shard:
        return call_replicated(pl)
    t = value_of(target)
    plain = all(args.get(k) is None for k in ("weight", "size_average", "reduce"))
    if (
        len(shape_of(x)) != 2 or pl.dim != 1 or pl.blocks or not plain
        or not isinstance(t, torch.Tensor) or t.is_floating_point()
    ):  # fmt: skip
        return fallback()
    vocab = shape_of(x)[1]
    call = Call(tp_ops.vocab_parallel_cross_entropy, (
        x, target, args.get("ignore_index", -100), args.get("reduction", "mean"),
        float(args.get("label_smoothing", 0.0)), vocab, ctx.rank, ctx.p, ctx.group,
    ))  # fmt: skip
    s = Strategy(out=R, call=call).read(target, R)
    # Every rank's [N, 2] statistics (log-sum-exp, target term), all-gathered forward;
    # the backward is local.
    s.cost = cost.gathers([ctx.p * cost.per_token(value_of(x), 2)], ctx.p)
    return s


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
            elif op_kind(user) == "cross_entropy":
                loss = loss or (user.args and user.args[0] is node)
            elif d < depth:
                frontier.append((user, d + 1))
    return bool(loss), leaves


# Ops between a head and its loss that keep every logit where it is on the vocabulary
# (the last) dim: casts, views, slices of other dims, element-wise scaling or soft-capping.
_LOGIT_STEPS = {"getitem", "cast", "contiguous", "view", "reshape", "flatten"}


def _reaches_loss_as_logits(head: fx.Node, depth: int = 16) -> bool:
    """Whether ``F.cross_entropy`` reads ``head``'s output as its classes, through such ops."""
    width = last_dim(head)
    frontier, seen = [(head, 0)], {head}
    while frontier:
        node, d = frontier.pop()
        for user in node.users:
            if user in seen or last_dim(user) != width and op_kind(user) != "cross_entropy":
                continue
            seen.add(user)
            if op_kind(user) == "cross_entropy":
                if (user.args[0] if user.args else user.kwargs.get("input")) is node:
                    return True
            elif d < depth and (op_kind(user) in _LOGIT_STEPS or is_elementwise_on_last_dim(user)):
                frontier.append((user, d + 1))
    return False


def tied_vocab_split(ctx: RuleContext, node: fx.Node, weight: fx.Node) -> str:
    """Why the embedding ``node`` fixes its ``weight`` split on the vocabulary; "" if not.

    Yes when the weight is tied to an LM head (every other reader of it is a
    contraction ``h @ W^T`` with the vocabulary as its output dim), ``V`` divides
    by ``p`` and the lookup is plain. The hidden split would make the head
    row-parallel, all-reducing partial logits ``[.., V]``; the vocabulary split
    costs a reduce-scatter and an all-gather of ``[.., d]`` instead, and the
    logits (if they leave the graph) are all-gathered, half an all-reduce. So it
    is chosen when ``V > 4d``, i.e. for any real vocabulary.
    """
    vocab, d = shape_of(weight)
    heads = _head_readers(ctx, weight)
    if not ctx.vocab_parallel or not heads or vocab % ctx.p or vocab <= 4 * d:
        return ""
    if not _plain_lookup(node):
        return ""
    return (
        f"{ctx.param_name(weight)}: tied embedding and head split on the vocabulary "
        f"(V={vocab} > 4d={4 * d}): the lookup is reduce-scattered onto the hidden shards "
        "and the head is vocabulary-parallel; no [.., V] partial logits are all-reduced"
    )


def _head_readers(ctx: RuleContext, weight: fx.Node) -> list[fx.Node]:
    """The contractions reading ``weight`` as ``[V, d]`` when every reader is one or a lookup."""
    params = ctx.param_names()
    heads: list[fx.Node] = []

    def head(n: fx.Node) -> bool:
        c = as_contraction(n, params)
        return c is not None and c.weight is weight and c.weight_layout == "out_in"

    for user in weight.users:
        if op_kind(user) == "embedding" and user.args[1] is weight and user.args[0] is not weight:
            continue
        if head(user):
            heads.append(user)
        elif user.users and all(head(u) for u in user.users):  # W.t() read by h @ W.t()
            heads.extend(user.users)
        else:
            return []
    return heads


def _plain_lookup(node: fx.Node) -> bool:
    args = _EMBEDDING_SIGNATURE.bind(*node.args, **node.kwargs).arguments
    return (
        args.get("max_norm") is None
        and not args.get("scale_grad_by_freq", False)
        and not args.get("sparse", False)
    )


def vocab_parallel_lookup(ctx: RuleContext, node: fx.Node, s: Strategy) -> Strategy:
    """An embedding whose weight is split on the vocabulary: a partial, then a reduce-scatter.

    Each rank looks up the ids of its vocabulary rows (zeros for the others):
    summed over ranks that is the full lookup, which a reduce-scatter hands out
    as hidden shards, the layout of the residual stream (no all-reduce of
    ``[.., d]`` and no slice after it).
    """
    args = _EMBEDDING_SIGNATURE.bind(*node.args, **node.kwargs).arguments
    ids, weight = args["input"], args["weight"]
    vocab = shape_of(weight)[0]
    part = vocab // ctx.p
    lo = ctx.rank * part
    pad = args.get("padding_idx")
    if pad is not None:
        pad = pad % vocab
        pad = pad - lo if lo <= pad < lo + part else None
    s.call = Call(tp_ops.vocab_shard_embedding, (ids, weight, pad, lo))
    s.out = P
    s.then = Then(S(len(shape_of(node)) - 1), "vocab embedding")
    return s
