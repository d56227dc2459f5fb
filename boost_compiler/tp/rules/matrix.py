"""Sharding rules of contractions: linear/matmul/addmm with a weight, batched matmuls, embedding.

Invariant: a contraction with a parameter is placed by the bottleneck role of
its node. A down factor is row-parallel (its input split on the contracted
dim, the partial result all-reduced at once, so no op ever reads a partial
value); an up factor is column-parallel (full input, output split on its
last dim, per block when every consumer splits a fused output into pieces).
A head whose logits reach a loss may go vocabulary-parallel (``vocab``);
any other contraction with a weight runs dense on full values. Contractions
of two activations (attention's ``q @ k^T``) are batched over the sharded
head dim and stay local when neither contracted dim is the shard.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from ...ir.op_table import op_kind
from ...ir.ops import as_contraction, shape_of
from ..placement import P, Placement, R, S
from .core import aligned, tensor_inputs
from .registry import Propagator, rule
from .slicing import sliced_blocks, split_sizes
from .vocab import tied_vocab_split, vocab_parallel_head, vocab_parallel_lookup


def _is_weight_contraction(prop: Propagator, node: fx.Node) -> bool:
    # Functions only: a ``x.matmul(W)`` method call never took this rule.
    return node.op == "call_function" and as_contraction(node, set(prop.param_names)) is not None


# always: the contraction decides its weight's placement from its role, whatever its input.
@rule("linear", "matmul", "mm", "addmm", guard=_is_weight_contraction, always=True)
def contraction(prop: Propagator, node: fx.Node) -> None:
    c = as_contraction(node, set(prop.param_names))
    assert c is not None
    role = prop.role.get(node.name)
    w_in = 1 if c.weight_layout == "out_in" else 0
    x_pl = prop.placement(c.input)
    x_nd = len(shape_of(c.input))
    if role == "up":
        node.replace_input_with(c.input, prop.to_replicate(c.input, node))
        blocks = _fused_blocks(prop, node)
        if not _take(prop, node, c.weight, S(1 - w_in, blocks)) or (
            c.bias is not None and not _take(prop, node, c.bias, S(0, blocks))
        ):
            return prop._fallback(node)
        return prop.set(node, S(len(shape_of(node)) - 1, blocks))
    w_pl = prop.env.get(c.weight) if c.weight not in prop.undecided else None
    # A weight already split on its input dim is row-parallel too. That is the
    # tied embedding / LM head: the embedding fixed the shared weight to
    # S(1) (hidden split), so the head contracts the hidden shard with the
    # local columns and all-reduces the partial logits. Exact, and it keeps
    # one layout for the one tensor; gathering the weight instead would
    # cost V*d per step against b*s*V here.
    row_parallel = role == "down" or w_pl == S(w_in)
    if row_parallel and (x_pl == S(x_nd - 1) or x_pl == R) and _take(prop, node, c.weight, S(w_in)):
        if x_pl == R:
            node.replace_input_with(c.input, prop.to_shard(c.input, x_nd - 1, node))
        return _row_parallel(prop, node, c.bias)
    if vocab_parallel_head(prop, node, c):  # an LM head whose logits reach a loss
        return
    # A dense consumer of the hidden (LM head, classifier): full input, full weight.
    prop._replicate_inputs(node)
    prop._decide(c.weight, R)
    if c.bias is not None:
        prop._decide(c.bias, R)
    prop.env[node] = R


def _take(prop: Propagator, node: fx.Node, param: fx.Node, want: Placement) -> bool:
    """Give ``node`` its parameter as ``want``; False when that cannot be done here.

    An earlier reader may have fixed the parameter replicated (``w.norm()`` or
    ``w.abs().mean()`` before the layer runs): this node then reads its slice of the
    replicated weight (exact; the gradient is gathered back). A blocked split of a
    replicated weight, or a weight fixed to another split, is refused, and the
    caller falls back to the dense, gathered computation.
    """
    got = prop._decide(param, want)
    if got == want:
        return True
    if got != R or want.blocks or param not in node.all_input_nodes:
        return False
    node.replace_input_with(param, prop.to_shard(param, want.dim, node))
    return True


def _row_parallel(prop: Propagator, node: fx.Node, bias: fx.Node | None) -> None:
    """All-reduce the partial product at once; the bias is added after, once, not per rank."""
    if bias is not None:
        args = list(node.args)
        args[2 if op_kind(node) != "addmm" else 0] = None
        node.args = tuple(args)
    prop.set(node, P)
    reduced = prop.to_replicate(node, node, "row-parallel")
    for user in list(node.users):
        if user is not reduced:
            user.replace_input_with(node, reduced)
    if bias is not None:
        # Added once to the full sum, so it must be whole: a bias fixed split (a forced
        # plan) is gathered first.
        if prop._decide(bias, R) != R:
            bias = prop.to_replicate(bias, node, "row-parallel bias")
        with prop.graph.inserting_after(reduced):
            added = prop.graph.call_function(operator.add, (reduced, bias))
        for user in list(reduced.users):
            if user is not added:
                user.replace_input_with(reduced, added)
        prop.env[added] = R


def _fused_blocks(prop: Propagator, node: fx.Node) -> tuple[int, ...]:
    """Block sizes when every consumer splits this up factor's output into pieces.

    A fused q/k/v (or gate/up) factor is column-parallel per piece: each rank
    takes its slice of q, of k and of v, so the split runs locally and every
    piece is an ordinary hidden shard. A contiguous split of the fused
    output would hand rank 0 all of q instead.
    """
    nd = len(shape_of(node))
    found = {split_sizes(u, nd - 1) for u in node.users}
    if len(found) != 1 or None in found:
        found = {sliced_blocks(node, nd - 1)}  # q = qkv[..., :a]; k = qkv[..., a:b]; ...
        if None in found:
            return ()
    [sizes] = found
    if len(sizes) < 2 or any(size % prop.p for size in sizes):
        return ()
    return sizes


@rule("matmul", "bmm", "sdpa")
def same_shard(prop: Propagator, node: fx.Node) -> None:
    """Ops that act independently along a batch-like sharded dim (attention heads)."""
    tensors = tensor_inputs(node)
    out = shape_of(node)
    pls = [prop.placement(a) for a in tensors]
    dims = {aligned(prop, a, out) for a, pl in zip(tensors, pls, strict=True) if pl.is_shard}
    if (
        len(dims) > 1
        and None not in dims
        and (found := _reshard_to_first(prop, node, tensors, out))
    ):
        tensors, dims = found
        pls = [prop.placement(a) for a in tensors]
    if len(dims) != 1 or None in dims or P in pls or any(pl.blocks for pl in pls):
        return prop._fallback(node)
    [k] = dims
    nd = len(out)
    if k >= nd - 2:  # the attention's own seq/feature dims must stay whole
        return prop._fallback(node)
    for a in tensors:
        if prop.placement(a) == R:
            s = shape_of(a)
            j = k - (nd - len(s))
            if j >= 0 and s[j] != 1:
                node.replace_input_with(a, prop.to_shard(a, j, node))
    prop.set(node, S(k))


def _reshard_to_first(
    prop: Propagator, node: fx.Node, tensors: list[fx.Node], out: tuple
) -> tuple[list[fx.Node], set[int]] | None:
    """Inputs split on another dim than the first input's batch-like dim: gathered whole.

    Multi-query attention: the queries are split on their heads, the one shared key/value
    head (a block of the fused projection) on its feature dim. The caller then slices
    each gathered input on the queries' heads, so every rank pairs its heads with the
    whole shared head. Exact (a gather, then a slice). None (nothing done) unless the
    first input is a shard on a dim the op batches over.
    """
    first = prop.placement(tensors[0])
    k = aligned(prop, tensors[0], out) if first.is_shard and not first.blocks else None
    if k is None or k >= len(out) - 2:
        return None
    for a in tensors[1:]:
        if prop.placement(a).is_shard and aligned(prop, a, out) != k:
            node.replace_input_with(a, prop.to_replicate(a, node, "to the queries' heads"))
    return tensor_inputs(node), {k}


# always: the embedding fixes its weight's split on first use.
@rule("embedding", always=True)
def embedding(prop: Propagator, node: fx.Node) -> None:
    """Hidden-dim split (every rank looks up its d/p columns, no communication), or,
    for a weight tied to the LM head, the vocabulary split that serves both."""
    ids, weight = node.args[0], node.args[1]
    if weight in prop.undecided:
        prop._decide(weight, S(0) if tied_vocab_split(prop, node, weight) else S(1))
    if prop.placement(ids) != R:
        return prop._fallback(node)
    if prop.placement(weight) == S(1):
        return prop.set(node, S(len(shape_of(node)) - 1))
    if prop.placement(weight) == S(0):
        return vocab_parallel_lookup(prop, node)
    prop._fallback(node)
