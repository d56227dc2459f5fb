"""Sharding rules of contractions: linear/matmul/addmm with a weight, batched matmuls, embedding.

Invariant: a contraction with a parameter is placed by the bottleneck role of
its node. A down factor is row-parallel (its input split on the contracted
dim, the partial result all-reduced at once, so no op ever reads a partial
value); an up factor is column-parallel (full input, output split on its
last dim, per block when every consumer splits a fused output into pieces).
A head whose logits reach a loss may go vocabulary-parallel (``vocab``).
A frozen weight with no role (a LoRA base) is split column- or row-parallel
as the factors are, or kept whole, as the planner weighs them (its memory
counted); any other contraction with a weight runs dense on full values. A weight
computed from parameters is whole on every rank: read as its slice against an input
split on the contracted dim (row-parallel), or the input gathered. Contractions
of two activations (attention's ``q @ k^T``) are batched over the sharded
head dim and stay local when neither contracted dim is the shard.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ...errors import ShardingError
from ...ir.op_table import op_kind
from ...ir.ops import (
    Contraction,
    as_contraction,
    contraction_operands,
    is_elementwise_on_last_dim,
    shape_of,
    weight_parameter,
)
from .. import sharded_ops as tp_ops
from ..placement import P, Placement, R, S
from ..strategy import Call, RuleContext, Strategy, Then, fallback
from .core import aligned, requires_grad, tensor_inputs
from .registry import rule
from .slicing import sliced_blocks, split_sizes
from .vocab import tied_vocab_split, vocab_parallel_head, vocab_parallel_lookup


def _is_weight_contraction(ctx: RuleContext, node: fx.Node) -> bool:
    # Functions only: a ``x.matmul(W)`` method call never took this rule.
    return node.op == "call_function" and as_contraction(node, ctx.param_names()) is not None


# always: the contraction decides its weight's placement from its role, whatever its input.
# reads_blocks: a fused weight's transpose (``x @ W.T``) is read blocked, as the weight is;
# a blocked input is read whole (column-parallel, a vocabulary head) or gathered.
@rule("linear", "matmul", "mm", "addmm", guard=_is_weight_contraction, always=True,
      reads_blocks=True)  # fmt: skip
def contraction(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    c = as_contraction(node, ctx.param_names())
    assert c is not None
    role = ctx.role(node)
    w_in = 1 if c.weight_layout == "out_in" else 0
    x_pl = ctx.placement(c.input)
    x_nd = len(shape_of(c.input))
    if role == "up":
        blocks = fused_blocks(ctx, node)
        s = Strategy(out=S(len(shape_of(node)) - 1, blocks)).read(c.input, R)
        if not _take(ctx, s, node, c.weight, S(1 - w_in, blocks)) or (
            c.bias is not None and not _take(ctx, s, node, c.bias, S(0, blocks))
        ):
            return _refused(s)
        return s
    # A weight already split on its input dim is row-parallel too. That is the
    # tied embedding / LM head: the embedding fixed the shared weight to
    # S(1) (hidden split), so the head contracts the hidden shard with the
    # local columns and all-reduces the partial logits. Exact, and it keeps
    # one layout for the one tensor; gathering the weight instead would
    # cost V*d per step against b*s*V here.
    if x_pl.blocks:  # read whole below (row-parallel needs a plain split of its input)
        x_pl = R
    row_parallel = role == "down" or ctx.peek(c.weight) == S(w_in)
    if row_parallel and x_pl in (S(x_nd - 1), R):
        s = Strategy(out=P)
        if _take(ctx, s, node, c.weight, S(w_in)):
            if x_pl == R:
                s.read(c.input, S(x_nd - 1))
            found = _row_parallel(ctx, s, node, c.bias)
            # A frozen base split so by parallelize: the alternatives it was decided among.
            return found if role or requires_grad(c.weight) else _same_layout(found, x_pl)
    head = vocab_parallel_head(ctx, node, c)  # an LM head whose logits reach a loss
    if head is not None:
        return head
    # A dense consumer of the hidden (LM head, classifier): full input, full weight.
    if ctx.is_open(c.weight) and not requires_grad(c.weight):
        return _frozen(ctx, node, c, w_in, x_pl in (S(x_nd - 1), R))
    return Strategy(out=R, whole=True)


def _frozen(
    ctx: RuleContext, node: fx.Node, c: Contraction, w_in: int, row_ok: bool
) -> list[Strategy]:
    """A frozen weight with no bottleneck role (a LoRA base, ``requires_grad=False``) split
    as the factors are: column-parallel (input whole, output split) like an up factor, or
    row-parallel (input split, partial sum converted) like a down factor; or kept whole.
    Each is exact; the planner weighs them, memory included (``Cost.held``): split, the
    weight needs no backward collective of its own, having no gradient. The row-parallel
    split keeps the input's layout: reduce-scattered from a hidden shard, all-reduced from
    a replicated input.

    Split only where the split dim divides by ``p``, and not where readers cut the output
    into pieces (a fused q/k/v would need a blocked split, which a saved plan may force
    only on an up factor: ``parallel/plan_fit.py``).
    """
    name = ctx.param_name(c.weight)
    w_shape, nd = shape_of(c.weight), len(shape_of(node))
    whole = Strategy(out=R, whole=True, label="whole", note=f"{name}: frozen weight kept whole")
    blocks = fused_blocks(ctx, node)
    if blocks:  # a fused q/k/v: each rank its slice of every piece
        s = Strategy(out=S(nd - 1, blocks), label="column-parallel per piece").read(c.input, R)
        s.note = f"{name}: frozen weight, column-parallel per piece {list(blocks)}"
        if _take(ctx, s, node, c.weight, S(1 - w_in, blocks)) and (
            c.bias is None or _take(ctx, s, node, c.bias, S(0, blocks))
        ):
            return [s, whole]
    if _cut(node, nd - 1):
        whole.note += " (its output is cut into pieces: a split would need blocks)"
        return [whole]
    found: list[Strategy] = []
    if not w_shape[1 - w_in] % ctx.p:
        s = Strategy(out=S(nd - 1), label="column-parallel").read(c.input, R)
        s.note = f"{name}: frozen weight, column-parallel (its {c.d_out} outputs split)"
        if _take(ctx, s, node, c.weight, S(1 - w_in)) and (
            c.bias is None or _take(ctx, s, node, c.bias, S(0))
        ):
            found.append(s)
    if row_ok and not w_shape[w_in] % ctx.p:
        s = Strategy(out=P, note=f"{name}: frozen weight, row-parallel (its {c.d_in} inputs split)")
        if _take(ctx, s, node, c.weight, S(w_in)):
            x_pl = ctx.placement(c.input)
            if x_pl == R:
                s.read(c.input, S(len(shape_of(c.input)) - 1))
            found += _same_layout(_row_parallel(ctx, s, node, c.bias), x_pl)
    return [*found, whole]


def _same_layout(rows: list[Strategy], x_pl: Placement) -> list[Strategy]:
    """A frozen base's row-parallel sums, kept in its input's layout where they can be: a
    hidden shard in, a hidden shard out (reduce-scattered). The base's output is summed with
    its adapter's, a shard; an all-reduce would hand that sum a whole value to slice, which
    the one-step lookahead cannot see where the adapter's term is computed after the base
    (``F.linear(x, W) + lora(x) * scale``)."""
    return [r for r in rows if x_pl == R or r.then is None or r.then.to != R] or rows


def _cut(node: fx.Node, dim: int) -> bool:
    """Whether a reader splits or slices ``node`` along ``dim`` into pieces."""
    return any(split_sizes(u, dim) is not None for u in node.users) or (
        sliced_blocks(node, dim) is not None
    )


def _refused(s: Strategy) -> Strategy:
    """The fallback, keeping what was fixed on the way (the weight of a refused bias)."""
    refused = fallback()
    refused.fix = s.fix
    return refused


def _take(ctx: RuleContext, s: Strategy, node: fx.Node, param: fx.Node, want: Placement) -> bool:
    """Read ``param`` as ``want`` in ``s``; False when that cannot be done here.

    An open parameter is fixed to ``want``. An earlier reader may have fixed it
    replicated (``w.norm()`` or ``w.abs().mean()`` before the layer runs): this node
    then reads its slice of the replicated weight (exact; the gradient is gathered
    back). A blocked split of a replicated weight, or a weight fixed to another split,
    is refused, and the caller falls back to the dense, gathered computation.
    """
    if ctx.is_open(param):
        s.fix[param] = want
        return True
    got = ctx.placement(param)
    if got == want:
        return True
    if got != R or want.blocks or param not in node.all_input_nodes:
        return False
    s.read(param, S(want.dim))
    return True


def _row_parallel(
    ctx: RuleContext, s: Strategy, node: fx.Node, bias: fx.Node | None
) -> list[Strategy]:
    """The partial product converted at once: all-reduced, or reduce-scattered onto the
    shards of its last dim (Megatron-SP's row-parallel output) where the readers take
    shards; the planner weighs the two. The bias is added to the converted sum, once,
    not per rank (whole, or its slice of the shards; one fixed split by a forced plan is
    gathered first).
    """
    if bias is not None:
        s.call = _bias_free(node)
    out = shape_of(node)
    reduced = replace(s, then=Then(R, "row-parallel", bias), label="all-reduce")
    if not out or not isinstance(out[-1], int) or out[-1] % ctx.p:
        return [reduced]
    to = S(len(out) - 1)
    scattered = replace(s, then=Then(to, "row-parallel", bias), label="reduce-scatter")
    return [reduced, scattered]


def _bias_free(node: fx.Node) -> Call:
    """The node's contraction without its bias: ``F.linear(x, W)``, ``torch.mm(x, W)``.

    ``addmm(b, x, W)`` has no bias-free form of itself (its ``input`` must be a tensor,
    and a zero one would still be added per rank), so it becomes ``mm(x, W)``: the same
    2-D operands, the same ``[n, d_out]`` result. ``as_contraction`` admits only the
    plain ``x @ W + b`` (no ``beta``/``alpha``, a ``[d_out]`` bias): nothing is dropped.
    """
    x, w, _ = contraction_operands(node)
    if op_kind(node) == "addmm":
        return Call(torch.mm, (x, w))
    if op_kind(node) != "linear":  # matmul and mm carry no bias; an assert vanishes under -O
        raise ShardingError(f"{node.format_node()}: a bias-free form of {op_kind(node)} "
                            "was asked for; only linear and addmm carry a bias")  # fmt: skip
    return Call(node.target, (x, w), {}, node.op)


def fused_blocks(ctx: RuleContext, node: fx.Node) -> tuple[int, ...]:
    """Block sizes when every consumer splits this up factor's output into pieces.

    A fused q/k/v (or gate/up) factor is column-parallel per piece: each rank
    takes its slice of q, of k and of v, so the split runs locally and every
    piece is an ordinary hidden shard. A contiguous split of the fused
    output would hand rank 0 all of q instead. (Also the experts' fused gate/up
    grouped GEMM's, ``experts.py``.)
    """
    nd = len(shape_of(node))
    found = {split_sizes(u, -1) for u in _last_dim_readers(node)}
    if len(found) != 1 or None in found:
        found = {sliced_blocks(node, nd - 1)}  # q = qkv[..., :a]; k = qkv[..., a:b]; ...
        if None in found:
            return ()
    [sizes] = found
    if len(sizes) < 2 or any(size % ctx.p for size in sizes):
        return ()
    return sizes


def _last_dim_readers(node: fx.Node) -> list[fx.Node]:
    """``node``'s readers, through ``unsqueeze`` ops that keep its last dim last
    (GPT-BigCode's ``c_attn(x).unsqueeze(1).split(sizes, dim=3)``) and element-wise ops of
    its shape (a fused q/k/v's frozen base plus its LoRA update, scaled, summed before the
    split): the blocked shard moves through them (``views.dim_move``,
    ``pointwise.elementwise``) to the split that reads it."""
    found = []
    for user in node.users:
        nd = len(shape_of(user) or ())
        at = user.args[1] if op_kind(user) == "unsqueeze" and len(user.args) == 2 else None
        if isinstance(at, int) and user.args[0] is node and at % max(nd, 1) != nd - 1:
            found += _last_dim_readers(user)
        elif (shape_of(user) == shape_of(node) and is_elementwise_on_last_dim(user)
              and op_kind(user) != "dropout"):  # fmt: skip
            found += _last_dim_readers(user)
        else:
            found.append(user)
    return found


def _few_kv_heads(ctx: RuleContext, node: fx.Node, pls: dict, k: int) -> int:
    """The key/value heads of a grouped-query ``sdpa`` (``enable_gqa``) with fewer of them
    than ranks, replicated (``views._few_heads``), whose queries are split on their heads:
    each rank's query heads then all read one key/value head. 0 for any other attention."""
    if op_kind(node) != "sdpa" or not node.kwargs.get("enable_gqa") or len(node.args) < 3:
        return 0
    q, key, value = node.args[:3]
    # held whole already: not multi-query's regathered head (read whole by the caller)
    if ctx.placement(key) != R or ctx.placement(value) != R or pls.get(q) != S(k) or k != 1:
        return 0
    heads, kv = shape_of(q)[1], shape_of(key)[1]
    if not (isinstance(heads, int) and isinstance(kv, int)) or not 1 < kv < ctx.p:
        return 0
    return kv if heads % ctx.p == 0 and ctx.p % kv == 0 and heads % kv == 0 else 0


@rule("matmul", "sdpa")
@rule("bmm", "baddbmm", reads_blocks=True)
def same_shard(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    """Ops that act independently along a batch-like sharded dim (attention heads).

    The batched matrix products also take that dim as equal blocks, every input alike
    (Bloom's batch and heads merged, ``[b*H, s, hd]``: each rank multiplies its heads of
    every sequence); a replicated input (ALiBi's ``[b*H, 1, s]`` bias) is read as the same
    blocks, sliced locally.
    """
    tensors = tensor_inputs(node)
    out = shape_of(node)
    nd = len(out)
    pls = {a: ctx.placement(a) for a in tensors}

    def at(a: fx.Node) -> int:  # the output dim a's shard dim broadcasts to
        return pls[a].dim + (nd - len(shape_of(a)))

    dims = {aligned(ctx, a, out) for a in tensors if pls[a].is_shard}
    regathered = set()
    if (
        len(dims) > 1
        and None not in dims
        and (k := _first_batch_dim(ctx, tensors, out)) is not None
    ):
        # Multi-query attention: the queries are split on their heads, the one shared
        # key/value head (a block of the fused projection) on its feature dim. Those read
        # whole, then sliced on the queries' heads: every rank pairs its heads with the
        # whole shared head. Exact (a gather, then a slice).
        regathered = {a for a in tensors[1:] if pls[a].is_shard and at(a) != k}
        pls.update({a: R for a in regathered})
        dims = {k}
    blocks = {pl.blocks for pl in pls.values() if pl.is_shard}
    if (computed := _computed_weight(ctx, node, pls)) is not None:
        return computed
    if len(dims) != 1 or None in dims or P in pls.values() or len(blocks) != 1:
        return fallback()
    [k], [blk] = dims, blocks
    if k >= nd - 2:  # the attention's own seq/feature dims must stay whole
        return fallback()
    s = Strategy(out=S(k, blk))
    kv = _few_kv_heads(ctx, node, pls, k)
    if kv:  # each rank's query heads share one key/value head: that one, sliced locally
        s.call = Call(tp_ops.one_kv_head_attention, (ctx.rank * kv // ctx.p, *node.args),
                      dict(node.kwargs))  # fmt: skip
    why = "to the queries' heads"
    for a in tensors:
        if kv and a in node.args[1:3]:
            continue
        if pls[a] == R:
            sh = shape_of(a)
            j = k - (nd - len(sh))
            if j >= 0 and sh[j] != 1:
                s.read(a, S(j, blk), why if a in regathered else "")
                if ctx.is_open(a) and not blk:  # a stack of weights: each rank its slice
                    s.fix[a] = S(j)
            elif a in regathered:
                s.read(a, R, why)
    return s


# Not a parameter's contraction (those take ``contraction`` by its guard): a weight
# computed from parameters (``x @ (W + B @ A).T``, a merged LoRA update).
@rule("linear", "mm")
def computed_weight(ctx: RuleContext, node: fx.Node) -> Strategy | list[Strategy]:
    pls = {a: ctx.placement(a) for a in tensor_inputs(node)}
    return _computed_weight(ctx, node, pls) or fallback()


def _computed_weight(
    ctx: RuleContext, node: fx.Node, pls: dict[fx.Node, Placement]
) -> list[Strategy] | None:
    """``x @ W`` / ``F.linear(x, W)`` with ``x`` split on the contracted dim and ``W`` a
    replicated matrix that is no parameter (computed from parameters, whole on every rank).

    Row-parallel on ``W``'s slice (each rank contracts its features, the partial sum
    converted at once, the bias added after it), or ``x`` gathered and the product run
    whole; exact both, the planner weighs their bytes (the sum is the cheaper where the
    product is narrower than ``x``). ``W``'s gradient, read as a slice, is gathered back.
    """
    kind = op_kind(node)
    if kind not in ("linear", "mm", "matmul"):
        return None
    x, w, bias = contraction_operands(node)
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or "out" in node.kwargs:
        return None
    if weight_parameter(w, ctx.param_names()) is not None:  # a parameter's: its own rule
        return None
    x_nd, w_shape = len(shape_of(x) or ()), shape_of(w)
    if w_shape is None or len(w_shape) != 2 or pls.get(w) != R or pls.get(x) != S(x_nd - 1):
        return None
    # A bias other than ``[d_out]`` (F.linear broadcasts any) would be sliced as if it were
    # one by the reduce-scatter: such a call runs whole.
    if bias is not None and (pls.get(bias) != R or shape_of(bias) != (w_shape[0],)):
        return None
    s = Strategy(out=P, label="weight computed whole: its slice, row-parallel")
    s.read(w, S(1 if kind == "linear" else 0), "the split input's features")
    gathered = Strategy(out=R, whole=True, label="input gathered, the product whole")
    return [*_row_parallel(ctx, s, node, bias), gathered]


def _first_batch_dim(ctx: RuleContext, tensors: list[fx.Node], out: tuple) -> int | None:
    """The output dim the first input is split on, when the op batches over it."""
    first = ctx.placement(tensors[0])
    k = aligned(ctx, tensors[0], out) if first.is_shard and not first.blocks else None
    return None if k is None or k >= len(out) - 2 else k


# always: the embedding fixes its weight's split on first use.
@rule("embedding", always=True)
def embedding(ctx: RuleContext, node: fx.Node) -> Strategy:
    """Hidden-dim split (every rank looks up its d/p columns, no communication), or,
    for a weight tied to the LM head, the vocabulary split that serves both."""
    ids, weight = node.args[0], node.args[1]
    s = Strategy()
    if ctx.is_open(weight):
        tied = tied_vocab_split(ctx, node, weight)
        s.fix[weight] = S(0) if tied else S(1)
        s.note = tied
    w_pl = s.fix.get(weight) or ctx.placement(weight)
    if ctx.placement(ids) != R:
        return _refused(s)
    if w_pl == S(1):
        s.out = S(len(shape_of(node)) - 1)
        return s
    if w_pl == S(0):
        return vocab_parallel_lookup(ctx, node, s)
    return _refused(s)
