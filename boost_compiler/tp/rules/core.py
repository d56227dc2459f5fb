"""Per-op sharding rules of :class:`~boost_compiler.tp.propagate.ShardingPropagator`.

A rule receives one dynamo-graph node whose inputs already have placements,
decides the node's placement from the op's semantics and the fake-tensor
shapes (never from module or parameter names), converts inputs where the op
needs it, and rewrites global size arguments to local ones. A rule that cannot
prove a sharded evaluation exact calls ``_fallback``, which gathers the inputs
(exact, slower) and logs a warning naming the op: an op without a rule is
never guessed at.

The rules are a mixin so that the propagator's walk and conversions
(``placement``, ``to_replicate``, ``to_shard``, ``set``, ``_decide``...) stay in
:mod:`~boost_compiler.tp.propagate`, readable on their own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...errors import ShardingError
from ...ir.ops import as_contraction, shape_of, value_of
from .. import kernels as tp_ops
from ..placement import P, Placement, R, S, shard_through_view

if TYPE_CHECKING:
    from ..propagate import ShardingResult

_ELEMENTWISE_FN = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.exp,
    torch.sigmoid, torch.tanh, torch.relu, torch.where, torch.clone,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
    F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.leaky_relu,
    operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne,
    torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne,
}  # fmt: skip
_ELEMENTWISE_METHOD = {
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "exp", "float", "half", "bfloat16",
    "to", "type", "type_as", "double", "contiguous", "clone", "silu", "sigmoid", "tanh", "relu", "masked_fill",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__", "detach",
    "gt", "lt", "ge", "le", "eq", "ne", "long", "int", "bool",
}  # fmt: skip
_VIEW_METHOD = {"view", "reshape", "flatten"}


class OpRules:
    """The op rules; mixed into :class:`~boost_compiler.tp.propagate.ShardingPropagator`."""

    if TYPE_CHECKING:  # provided by ShardingPropagator
        graph: fx.Graph
        param_names: dict[str, str]
        p: int
        group: str
        rank: int
        role: dict[str, str]
        env: dict[fx.Node, Placement]
        undecided: set[fx.Node]
        result: ShardingResult

        def _decide(self, node: fx.Node, placement: Placement) -> Placement: ...
        def peek(self, arg: Any) -> Placement | None: ...
        def placement(self, arg: Any) -> Placement: ...
        def to_replicate(self, arg: Any, user: fx.Node, reason: str = "") -> Any: ...
        def to_shard(self, arg: Any, dim: int, user: fx.Node) -> Any: ...
        def set(self, node: fx.Node, placement: Placement) -> None: ...
        def _record(
            self, kind: str, new: fx.Node, src: fx.Node, fwd: bool, bwd: bool, reason: str
        ) -> None: ...
        def _fallback(self, node: fx.Node) -> None: ...
        def _replicate_inputs(self, node: fx.Node) -> None: ...

    def _rule_for(self, node: fx.Node) -> Callable[[fx.Node], None] | None:
        t = node.target
        if node.op == "call_function":
            if as_contraction(node, set(self.param_names)) is not None:
                return self._contraction
            if t in _ELEMENTWISE_FN:
                return self._elementwise
            if t is F.dropout:
                return self._dropout
            if t is F.cross_entropy:
                return self._cross_entropy
            if t is F.embedding:
                return self._embedding
            if t in (torch.rms_norm, F.rms_norm, F.layer_norm, torch.layer_norm):
                return self._norm
            if t is F.scaled_dot_product_attention or t in _ACT_MATMUL:
                return self._same_shard  # batched over heads; as_contraction took weights
            if t in _SPLITS or t in _SOFTMAX:
                return self._along_other_dim
            if t is operator.getitem:
                return self._getitem
            if t in (torch.cat, torch.stack):
                return self._cat
            if t in (torch.reshape, torch.flatten):
                return self._view
            if t in (torch.slice_scatter, torch.select_scatter):
                return self._scatter
        elif node.op == "call_method":
            if node.meta.get("boost_input_write"):
                return self._input_write
            if t in _ELEMENTWISE_METHOD:
                return self._elementwise
            if t in _VIEW_METHOD:
                return self._view
            if t in ("transpose", "permute", "unsqueeze", "squeeze"):
                return self._dim_move
            if t == "expand":
                return self._expand
            if t in ("chunk", "split", "repeat_interleave", "softmax"):
                return self._along_other_dim
            if t in ("matmul", "__matmul__"):
                return self._same_shard
            if t in ("mean", "sum"):
                return self._reduction
        if node.op == "call_function" and t in (torch.mean, torch.sum):
            return self._reduction
        return None

    def _elementwise(self, node: fx.Node) -> None:
        out = shape_of(node)
        tensors = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
        if any(self.peek(a) == P for a in tensors):
            self._replicate_inputs(node)
        dims = {self._aligned(a, out) for a in tensors if (pl := self.peek(a)) and pl.is_shard}
        if not dims:
            self.env[node] = R
            return
        # None: a sharded input of an op with no tensor output (``torch.where(mask)``'s
        # index tuple): gathered, never called replicated on a shard.
        if out is None or len(dims) > 1 or None in dims:
            return self._fallback(node)
        [k] = dims
        nd = len(out)
        for a in tensors:
            s = shape_of(a) or ()
            j = k - (nd - len(s))  # the operand's dim aligned to output dim k
            if j < 0 or s[j] == 1:
                continue  # broadcast along the sharded dim: use it whole
            if a in self.undecided:
                self._decide(a, S(j))
            elif self.peek(a) == R:
                node.replace_input_with(a, self.to_shard(a, j, node))
        self.set(node, S(k))

    def _aligned(self, a: fx.Node, out: tuple[Any, ...] | None) -> int | None:
        pl, s = self.placement(a), shape_of(a)
        if out is None or s is None:
            return None
        return pl.dim + (len(out) - len(s))

    def _contraction(self, node: fx.Node) -> None:
        c = as_contraction(node, set(self.param_names))
        assert c is not None
        role = self.role.get(node.name)
        w_in = 1 if c.weight_layout == "out_in" else 0
        x_pl = self.placement(c.input)
        x_nd = len(shape_of(c.input))
        if role == "up":
            node.replace_input_with(c.input, self.to_replicate(c.input, node))
            blocks = self._fused_blocks(node)
            self._decide(c.weight, S(1 - w_in, blocks))
            if c.bias is not None:
                self._decide(c.bias, S(0, blocks))
            return self.set(node, S(len(shape_of(node)) - 1, blocks))
        w_pl = self.env.get(c.weight) if c.weight not in self.undecided else None
        # A weight already split on its input dim is row-parallel too. That is the
        # tied embedding / LM head: the embedding fixed the shared weight to
        # S(1) (hidden split), so the head contracts the hidden shard with the
        # local columns and all-reduces the partial logits. Exact, and it keeps
        # one layout for the one tensor; gathering the weight instead would
        # cost V*d per step against b*s*V here.
        row_parallel = role == "down" or w_pl == S(w_in)
        if row_parallel and (x_pl == S(x_nd - 1) or x_pl == R):
            if x_pl == R:
                node.replace_input_with(c.input, self.to_shard(c.input, x_nd - 1, node))
            self._decide(c.weight, S(w_in))
            bias = c.bias
            if bias is not None:  # added once, after the reduction, not once per rank
                args = list(node.args)
                args[2 if node.target is not torch.addmm else 0] = None
                node.args = tuple(args)
            self.set(node, P)
            reduced = self.to_replicate(node, node, "row-parallel")
            for user in list(node.users):
                if user is not reduced:
                    user.replace_input_with(node, reduced)
            if bias is not None:
                with self.graph.inserting_after(reduced):
                    added = self.graph.call_function(operator.add, (reduced, bias))
                for user in list(reduced.users):
                    if user is not added:
                        user.replace_input_with(reduced, added)
                self._decide(bias, R)
                self.env[added] = R
            return
        if self._vocab_parallel_head(node, c):  # an LM head whose logits reach a loss
            return
        # A dense consumer of the hidden (LM head, classifier): full input, full weight.
        self._replicate_inputs(node)
        self._decide(c.weight, R)
        if c.bias is not None:
            self._decide(c.bias, R)
        self.env[node] = R

    def _fused_blocks(self, node: fx.Node) -> tuple[int, ...]:
        """Block sizes when every consumer splits this up factor's output into pieces.

        A fused q/k/v (or gate/up) factor is column-parallel per piece: each rank
        takes its slice of q, of k and of v, so the split runs locally and every
        piece is an ordinary hidden shard. A contiguous split of the fused
        output would hand rank 0 all of q instead.
        """
        nd = len(shape_of(node))
        found = {_split_sizes(u, nd - 1) for u in node.users}
        if len(found) != 1 or None in found:
            found = {_sliced_blocks(node, nd - 1)}  # q = qkv[..., :a]; k = qkv[..., a:b]; ...
            if None in found:
                return ()
        [sizes] = found
        if len(sizes) < 2 or any(size % self.p for size in sizes):
            return ()
        return sizes

    def _dropout(self, node: fx.Node) -> None:
        """Replicated input: plain dropout (synchronised streams give every rank one mask).

        Sharded input: :func:`tp_ops.sharded_dropout`, independent masks per shard.
        """
        names = ("input", "p", "training", "inplace")
        bound = {"p": 0.5, "training": True, **dict(zip(names, node.args, strict=False))}
        bound.update(node.kwargs)
        x = bound["input"]
        pl = self.placement(x)
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        node.target = tp_ops.sharded_dropout
        node.args = (x, bound["p"], bound["training"], pl.dim, self.rank, self.p)
        node.kwargs = {}
        self.set(node, pl)

    def _embedding(self, node: fx.Node) -> None:
        ids, weight = node.args[0], node.args[1]
        if weight in self.undecided:
            # Hidden-dim split: every rank looks up its d/p columns, no communication.
            self._decide(weight, S(1))
        if self.placement(weight) == S(1) and self.placement(ids) == R:
            return self.set(node, S(len(shape_of(node)) - 1))
        self._fallback(node)

    def _norm(self, node: fx.Node) -> None:
        x = node.args[0]
        nd = len(shape_of(node))
        if self.peek(x) != S(nd - 1) or len(node.args[1]) != 1:
            self._replicate_inputs(node)
            self.env[node] = R
            return
        names = ("input", "normalized_shape", "weight", "eps")
        if node.target in (F.layer_norm, torch.layer_norm):
            names = ("input", "normalized_shape", "weight", "bias", "eps")
        bound = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
        weight, bias, eps = bound.get("weight"), bound.get("bias"), bound.get("eps")
        for prm in (weight, bias):
            if isinstance(prm, fx.Node) and prm in self.undecided:
                self._decide(prm, S(0))
        w, b = self._shard_arg(weight, node), self._shard_arg(bias, node)
        d = node.args[1][0]
        if "bias" in names:
            node.target, node.args = tp_ops.sharded_layer_norm, (x, w, b, eps, d, self.group)
        else:
            node.target, node.args = tp_ops.sharded_rms_norm, (x, w, eps, d, self.group)
        node.kwargs = {}
        stats = 1 if "bias" not in names else 2  # RMSNorm: sum of squares; LayerNorm: + mean
        for _ in range(stats):
            self._record("all_reduce", node, x, fwd=True, bwd=True, reason="norm statistics")
            self.result.collectives[-1].global_shape = (*shape_of(x)[:-1], 1)
            self.result.collectives[-1].dtype = torch.float32  # tp_ops reduce stats in fp32
        self.set(node, S(nd - 1))

    def _shard_arg(self, prm: Any, node: fx.Node) -> Any:
        if isinstance(prm, fx.Node) and self.placement(prm) == R:
            return self.to_shard(prm, 0, node)
        return prm

    def _same_shard(self, node: fx.Node) -> None:
        """Ops that act independently along a batch-like sharded dim (attention heads)."""
        tensors = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
        out = shape_of(node)
        pls = [self.placement(a) for a in tensors]
        if all(pl == R for pl in pls):
            self.env[node] = R
            return
        dims = {self._aligned(a, out) for a, pl in zip(tensors, pls, strict=True) if pl.is_shard}
        if len(dims) != 1 or None in dims or P in pls or any(pl.blocks for pl in pls):
            return self._fallback(node)
        [k] = dims
        nd = len(out)
        if k >= nd - 2:  # the attention's own seq/feature dims must stay whole
            return self._fallback(node)
        for a in tensors:
            if self.placement(a) == R:
                s = shape_of(a)
                j = k - (nd - len(s))
                if j >= 0 and s[j] != 1:
                    node.replace_input_with(a, self.to_shard(a, j, node))
        self.set(node, S(k))

    def _view(self, node: fx.Node) -> None:
        x = node.args[0]
        pl = self.placement(x)
        if pl == R:
            self.env[node] = R
            return
        if pl == P:
            self._replicate_inputs(node)
            self.env[node] = R
            return
        src, dst = shape_of(x), shape_of(node)
        moved = shard_through_view(src, dst, pl.dim, self.p)
        if node.target in ("flatten", torch.flatten):
            # Its arguments are dims, not sizes: the same call flattens the local
            # shard. Exact when the shard dim leads its merged group (or is outside
            # it), which shard_through_view checks: each rank's block stays whole.
            if moved is None or moved[1] % self.p:
                return self._fallback(node)
            return self.set(node, S(moved[0]))
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = tuple(sizes[0])
        if moved is None or len(sizes) != len(dst):
            return self._fallback(node)
        k, divisor = moved
        if divisor % self.p:
            raise ShardingError(
                f"{_describe(node)}: dimension {k} of size {divisor} (heads or hidden) is not "
                f"divisible by the tensor-parallel degree p={self.p}"
            )
        new_sizes = list(sizes)
        if isinstance(new_sizes[k], int) and new_sizes[k] != -1:
            new_sizes[k] //= self.p
        elif not (isinstance(new_sizes[k], int) and new_sizes[k] == -1):
            return self._fallback(node)
        node.args = (x, *new_sizes)
        self.set(node, S(k))

    def _dim_move(self, node: fx.Node) -> None:
        x = node.args[0]
        pl = self.placement(x)
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        src, dst = len(shape_of(x)), len(shape_of(node))
        t = node.target
        if t == "transpose":
            a, b = (d % src for d in node.args[1:3])
            k = b if pl.dim == a else a if pl.dim == b else pl.dim
        elif t == "permute":
            perm = node.args[1:] if isinstance(node.args[1], int) else node.args[1]
            k = [d % src for d in perm].index(pl.dim)
        elif t == "unsqueeze":
            u = node.args[1] % dst
            k = pl.dim + (1 if u <= pl.dim else 0)
        else:
            return self._fallback(node)
        self.set(node, S(k))

    def _expand(self, node: fx.Node) -> None:
        """``expand`` broadcasts size-1 dims and adds leading ones; a sharded dim keeps its size.

        HF's ``repeat_kv`` (``kv[:, :, None].expand(b, h_kv, n_rep, s, d)``, then a
        reshape merging ``h_kv * n_rep``) is the case that matters: the sharded
        kv-head dim is never a size-1 dim (a shard of size 1 globally cannot
        divide), so it is not broadcast, and its target size becomes -1 ("keep"),
        which is the local size on every rank.
        """
        x = node.args[0]
        pl = self.placement(x)
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = tuple(sizes[0])
        out = shape_of(node)
        k = pl.dim + len(out) - len(shape_of(x))
        if len(sizes) != len(out) or node.kwargs:
            return self._fallback(node)
        new_sizes = list(sizes)
        new_sizes[k] = -1
        node.args = (x, *new_sizes)
        self.set(node, S(k))

    def _along_other_dim(self, node: fx.Node) -> None:
        """chunk/split/repeat_interleave/softmax along a dim that is not the sharded one."""
        x = node.args[0]
        pl = self.placement(x)
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        nd = len(shape_of(x))
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if node.target in _SPLITS:
            if pl.blocks and _split_sizes(node, pl.dim) == pl.blocks:
                return self._split_blocks(node, pl)
            if dim is None:
                dim = 0
        if node.target in _SOFTMAX:
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if pl.blocks or dim is None or dim % nd == pl.dim and node.target != "repeat_interleave":
            return self._fallback(node)
        # repeat_interleave along the head dim keeps contiguous head blocks aligned:
        # local kv head j serves local q heads [j*n_rep, (j+1)*n_rep).
        self.set(node, pl)

    def _split_blocks(self, node: fx.Node, pl: Placement) -> None:
        """Split a blocked shard into its blocks: local sizes, plain shards out."""
        if node.target in ("split", torch.split):  # chunk(n) already means 1/n locally
            local = [size // self.p for size in pl.blocks]
            kwargs = dict(node.kwargs)
            for key in ("split_size", "split_size_or_sections"):
                kwargs.pop(key, None)
            node.args, node.kwargs = (node.args[0], local, *node.args[2:]), kwargs
        self.set(node, S(pl.dim))

    def _call_replicated(self, node: fx.Node, pl: Placement) -> None:
        if pl == P:
            self._replicate_inputs(node)
        self.env[node] = R

    def _getitem(self, node: fx.Node) -> None:
        src, idx = node.args
        pl = self.placement(src)
        if not isinstance(value_of(src), torch.Tensor):
            self.env[node] = pl  # an element of chunk()/split(): same placement
            return
        if any(self.placement(a) != R for a in node.all_input_nodes if a is not src):
            return self._fallback(node)  # an index tensor that differs per rank
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        idx = idx if isinstance(idx, tuple) else (idx,)
        if pl.blocks:
            return self._getitem_block(node, src, idx, pl)
        nd = len(shape_of(src))
        k = _dim_after_index(idx, pl.dim, nd)
        if k is None:
            # One replicated integer index tensor on another dim (a MoE block's
            # ``hidden[token_ids]``): every rank gathers the same rows of its own
            # columns, and the backward (index_put, accumulate) stays per column.
            k = _dim_after_tensor_index(idx, pl.dim, nd)
            out = shape_of(node)
            if k is None or out is None or out[k] != shape_of(src)[pl.dim]:
                return self._fallback(node)
            # Already gathered (a MoE router read the full hidden, through its own
            # reshape and cast): index that copy, free; the rows picked (top-k: k
            # per token) would cost k times more to gather later.
            root, shape, dtype = _same_values(src)
            gathered = next(
                (
                    g
                    for (c, to), g in self.converted.items()
                    if to == R
                    and (same := _same_values(c))[0] is root
                    and same[1:] == (shape, dtype)
                ),
                None,
            )
            if gathered is not None:
                node.replace_input_with(src, gathered)
                self.env[node] = R
                return
        self.set(node, S(k))

    def _getitem_block(self, node: fx.Node, src: fx.Node, idx: tuple, pl: Placement) -> None:
        """A slice that is exactly one block of a blocked shard: that block's local columns."""
        nd = len(shape_of(src))
        span = _last_dim_slice(idx, shape_of(src))
        starts = [sum(pl.blocks[:i]) for i in range(len(pl.blocks))]
        if (
            pl.dim != nd - 1
            or span is None
            or span not in {(a, a + size) for a, size in zip(starts, pl.blocks, strict=True)}
        ):
            return self._fallback(node)
        start, stop = span[0] // self.p, span[1] // self.p
        node.args = (src, (*idx[:-1], slice(start, stop)))
        self.set(node, S(pl.dim))

    def _cat(self, node: fx.Node) -> None:
        """Concatenation along a dim other than the shard dim stays sharded.

        Replicated pieces are sliced to the same shard (no communication), so
        a cache of past keys (replicated input) joins this step's head-sharded
        keys. 1-D empty tensors are skipped by ``torch.cat`` whatever the other
        pieces' rank (HF's empty ``DynamicCache`` layers start as ``tensor([])``);
        they stay in the arguments and are skipped locally too.
        """
        tensors = [t for t in node.args[0] if not _legacy_empty(t)]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        nd = len(shape_of(node))
        if any(self.peek(t) == P for t in tensors):
            self._replicate_inputs(node)
        pls = {self.placement(t) for t in tensors}
        if pls <= {R}:
            self.env[node] = R
            return
        shards = pls - {R}
        if node.target is torch.stack:
            # A new dim at ``dim``: never the shard dim, which moves past it. Every
            # piece the same shape, each rank stacks its own columns of each.
            if len(shards) != 1 or (pl := next(iter(shards))).blocks:
                return self._fallback(node)
            d = dim % nd
            for t in tensors:
                if self.placement(t) == R:
                    node.replace_input_with(t, self.to_shard(t, pl.dim, node))
            return self.set(node, S(pl.dim + (1 if pl.dim >= d else 0)))
        if len(shards) != 1 or (pl := next(iter(shards))).dim == dim % nd:
            return self._fallback(node)
        for t in tensors:
            if self.placement(t) == R:
                node.replace_input_with(t, self.to_shard(t, pl.dim, node))
        self.set(node, pl)

    def _scatter(self, node: fx.Node) -> None:
        """``slice_scatter``/``select_scatter`` (written by ``functionalize``) off the shard dim."""
        base, src = node.args[0], node.args[1]
        if P in (self.peek(base), self.peek(src)):
            self._replicate_inputs(node)
            base, src = node.args[0], node.args[1]
        nd = len(shape_of(base))
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % nd
        pb, ps = self.placement(base), self.placement(src)
        if pb == R and ps == R:
            self.env[node] = R
            return
        select = node.target is torch.select_scatter
        k = pb.dim if pb.is_shard else ps.dim + (1 if select and ps.dim >= dim else 0)
        k_src = k - (1 if select and k > dim else 0)  # src lacks the selected dim
        if k == dim or pb.blocks or ps.blocks or pb not in (R, S(k)) or ps not in (R, S(k_src)):
            return self._fallback(node)
        if pb == R:
            node.replace_input_with(base, self.to_shard(base, k, node))
        if ps == R:
            node.replace_input_with(src, self.to_shard(src, k_src, node))
        self.set(node, S(k))

    def _input_write(self, node: fx.Node) -> None:
        """The ``copy_`` into a mutated graph input that ``functionalize`` appends: the full value."""
        target, value = node.args
        node.args = (target, self.to_replicate(value, node, "input write"))
        self.env[node] = R

    def _reduction(self, node: fx.Node) -> None:
        x = node.args[0]
        pl = self.placement(x)
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        nd = len(shape_of(x))
        dims = (
            None
            if dim is None
            else {d % nd for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
        )
        keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        if dims is not None and pl.dim not in dims and not pl.blocks:
            # Over other dims only (batch, sequence): each rank reduces its own columns.
            return self.set(node, S(pl.dim - (0 if keepdim else sum(d < pl.dim for d in dims))))
        if dims != {pl.dim}:
            return self._fallback(node)
        if keepdim and pl.dim == nd - 1 and self._written_rms_norm(node, x):
            return
        full = shape_of(x)[pl.dim]
        fn = tp_ops.sharded_mean if node.target in ("mean", torch.mean) else tp_ops.sharded_sum
        node.op, node.target = "call_function", fn
        node.args, node.kwargs = (x, pl.dim, bool(keepdim), full, self.group), {}
        self._record("all_reduce", node, node, fwd=True, bwd=False, reason="reduction")
        self.env[node] = R

    def _written_rms_norm(self, mean: fx.Node, sq: fx.Node) -> bool:
        """An RMSNorm written out (HF's ``LlamaRMSNorm``), made one sharded norm node.

        ``x * rsqrt(mean(x**2, -1, keepdim=True) + eps)``, optionally cast back to the
        dtype ``x`` had before an fp32 upcast and multiplied by a ``[d]`` weight, is
        ``torch.rms_norm`` computed in fp32: :func:`tp_ops.sharded_rms_norm` does the
        same arithmetic (fp32 statistics, cast, then the weight), so replacing the
        chain is exact. Why bother, when the generic rules already shard every op of
        it exactly: the generic path all-reduces the mean on its own, forward and
        (through ``f`` on the scale) backward, while one norm node is what the
        ``online_norm`` pass folds into the next down factors' all-reduce, so a
        written-out norm costs no collective, as BOOST's does. Matched on the
        dataflow only (every intermediate used once, eps a constant, ``x`` fp32);
        anything else keeps the generic rules.
        """
        if mean.target not in ("mean", torch.mean) or len(sq.users) != 1:
            return False
        if len(mean.args) > 3 or not set(mean.kwargs) <= {"dim", "keepdim"}:
            return False  # e.g. mean(..., dtype=torch.float64): another arithmetic
        xf = _square_of(sq)
        value = value_of(xf)
        if xf is None or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            return False
        add = _only_user(mean)
        eps = _added_constant(add, mean) if add is not None else None
        rs = _only_user(add) if eps is not None else None
        if rs is None or not _is_op(rs, _RSQRT):
            return False
        scaled = _only_user(rs)
        if scaled is None or not _is_op(scaled, _MUL) or set(scaled.args) != {xf, rs}:
            return False
        chain = [sq, mean, add, rs, scaled]
        # The input the norm reads: x itself, or what x was cast from if the chain
        # casts back to that dtype (HF: .to(torch.float32) ... .to(input_dtype)).
        x, end = xf, scaled
        src = xf.args[0] if _is_cast(xf) else None
        cast = _only_user(scaled)
        if src is not None and cast is not None and _is_cast(cast):
            if value_of(cast).dtype == value_of(src).dtype:
                x, end = src, cast
                chain.append(cast)
        elif src is not None and value_of(src).dtype == torch.float32:
            x = src  # the upcast was a no-op
        if self.peek(x) != self.peek(xf):
            x, end = xf, scaled  # (a cast is element-wise: only a defensive check)
            chain = chain[:5]
        d = shape_of(xf)[-1]
        weight = None
        wm = _only_user(end)
        if wm is not None and _is_op(wm, _MUL) and end in wm.args and len(wm.args) == 2:
            w = wm.args[1] if wm.args[0] is end else wm.args[0]
            if isinstance(w, fx.Node) and shape_of(w) == (d,) and self.peek(w) in (None, R, S(0)):
                weight, end = w, wm
                chain.append(wm)
        if weight is not None and weight in self.undecided:
            self._decide(weight, S(0))
        with self.graph.inserting_before(end):
            norm = self.graph.call_function(
                tp_ops.sharded_rms_norm,
                (x, self._shard_arg(weight, end), float(eps), d, self.group),
            )
        norm.meta = dict(end.meta)
        end.replace_all_uses_with(norm)
        for n in reversed(chain):
            self.graph.erase_node(n)
        if x is not xf and not xf.users:
            self.graph.erase_node(xf)
        self._record("all_reduce", norm, x, fwd=True, bwd=True, reason="norm statistics")
        self.result.collectives[-1].global_shape = (*shape_of(x)[:-1], 1)
        self.result.collectives[-1].dtype = torch.float32
        self.set(norm, S(len(shape_of(x)) - 1))
        return True


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


_MUL = (operator.mul, torch.mul, "mul", "__mul__", "__rmul__")
_ADD = (operator.add, torch.add, "add", "__add__", "__radd__")
_RSQRT = (torch.rsqrt, "rsqrt")
_CASTS = ("to", "float", "half", "bfloat16", "double", "type")


def _is_op(node: fx.Node, targets: tuple[Any, ...]) -> bool:
    return node.op in ("call_function", "call_method") and node.target in targets


def _is_cast(node: fx.Node) -> bool:
    """A dtype conversion of one tensor (same device), nothing else."""
    if node.op != "call_method" or node.target not in _CASTS or len(node.all_input_nodes) != 1:
        return False
    a, b = value_of(node.args[0]), value_of(node)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device


def _square_of(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` is ``x ** 2``, ``x.pow(2)``, ``x * x`` or ``x.square()``."""
    args = node.args
    if _is_op(node, (operator.pow, torch.pow, "pow")) and len(args) == 2 and args[1] == 2:
        x = args[0]
    elif _is_op(node, _MUL) and len(args) == 2 and args[0] is args[1]:
        x = args[0]
    elif _is_op(node, (torch.square, "square")) and len(args) == 1:
        x = args[0]
    else:
        return None
    return x if isinstance(x, fx.Node) and not node.kwargs else None


def _added_constant(add: fx.Node, to: fx.Node) -> float | None:
    """``c`` when ``add`` is ``to + c`` with a Python number ``c`` (no alpha)."""
    if not _is_op(add, _ADD) or add.kwargs or len(add.args) != 2 or to not in add.args:
        return None
    c = add.args[1] if add.args[0] is to else add.args[0]
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None


_SPLITS = ("chunk", "split", torch.split, torch.chunk)
# Ops that may read a blocked shard (each reads whole blocks); any other op gathers it.
_BLOCK_READERS = (*_SPLITS, operator.getitem)
_ACT_MATMUL = (torch.matmul, operator.matmul, torch.bmm)
_SOFTMAX = ("softmax", torch.softmax, F.softmax)


def _split_sizes(node: fx.Node, dim: int) -> tuple[int, ...] | None:
    """The global piece sizes when ``node`` splits or chunks along ``dim``, else None."""
    if node.target not in _SPLITS:
        return None
    pieces = value_of(node)
    if not isinstance(pieces, (tuple, list)) or not pieces:
        return None
    nd = pieces[0].dim()
    given = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if not isinstance(given, int) or given % nd != dim % nd:
        return None
    sizes = tuple(t.shape[dim] for t in pieces)
    return sizes if all(isinstance(size, int) for size in sizes) else None


def _last_dim_slice(idx: tuple[Any, ...], shape: tuple[Any, ...]) -> tuple[int, int] | None:
    """``(start, stop)`` when ``x[idx]`` only slices the last dim, with static bounds."""
    nd, full = len(shape), shape[-1]
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = (*idx[:at], *[slice(None)] * (nd - len(idx) + 1), *idx[at + 1 :])
    if len(idx) != nd or any(i != slice(None) for i in idx[:-1]):
        return None
    last = idx[-1]
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    start, stop = last.start or 0, full if last.stop is None else last.stop
    if not all(isinstance(v, int) for v in (start, stop, full)) or start < 0 or stop < 0:
        return None
    return start, min(stop, full)


def _sliced_blocks(node: fx.Node, dim: int) -> tuple[int, ...] | None:
    """Block sizes when every user slices ``node``'s last dim and the slices tile it."""
    full = shape_of(node)[dim]
    spans = set()
    for user in node.users:
        if user.target is not operator.getitem or user.args[0] is not node:
            return None
        idx = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
        span = _last_dim_slice(idx, shape_of(node))
        if span is None:
            return None
        spans.add(span)
    ordered = sorted(spans)
    if not ordered or ordered[0][0] != 0 or ordered[-1][1] != full:
        return None
    if any(a[1] != b[0] for a, b in zip(ordered, ordered[1:], strict=False)):
        return None
    return tuple(b - a for a, b in ordered)


def _dim_after_index(idx: tuple[Any, ...], dim: int, nd: int) -> int | None:
    """Where dim ``dim`` goes after ``x[idx]``; None if the index touches it."""
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (nd - n_real))
        else:
            expanded.append(i)
    out = src = 0
    for i in expanded:
        if i is None:
            out += 1
            continue
        if src == dim:
            return out if i == slice(None) else None
        if isinstance(i, int):
            src += 1
            continue
        if isinstance(i, slice):
            src += 1
            out += 1
            continue
        return None  # tensor indexing
    return out + (dim - src)


_INDEX_DTYPES = (torch.int64, torch.int32)
_RESHAPES = ("view", "reshape", "flatten", torch.reshape, torch.flatten)


def _same_values(node: fx.Node) -> tuple[fx.Node, tuple[Any, ...], Any]:
    """``(root, shape, dtype)``: equal for two nodes that hold the same values.

    ``root`` is reached through reshapes (row-major: the values depend only on the
    input and the shape), ``contiguous`` and casts to the dtype the tensor already
    has; anything else is a root.
    """
    shape, dtype = tuple(shape_of(node) or ()), getattr(value_of(node), "dtype", None)
    while node.op in ("call_function", "call_method") and node.args:
        src = node.args[0]
        if not isinstance(src, fx.Node) or getattr(value_of(src), "dtype", None) != dtype:
            break
        if not (node.target in _RESHAPES or node.target == "contiguous" or _is_cast(node)):
            break
        node = src
    return node, shape, dtype


def _dim_after_tensor_index(idx: tuple[Any, ...], dim: int, nd: int) -> int | None:
    """Where dim ``dim`` goes after ``x[idx]`` when ``idx`` is one integer index tensor
    on another dim and full slices elsewhere (its dims replace the indexed one in
    place); None for anything else (masks, several tensors, ``None``, ints)."""
    if None in idx or sum(i is Ellipsis for i in idx) > 1:
        return None
    n_real = sum(1 for i in idx if i is not Ellipsis)
    expanded: list[Any] = []
    for i in idx:
        expanded.extend([slice(None)] * (nd - n_real) if i is Ellipsis else [i])
    expanded.extend([slice(None)] * (nd - len(expanded)))
    tensors = [j for j, i in enumerate(expanded) if isinstance(i, fx.Node)]
    if len(expanded) != nd or len(tensors) != 1:
        return None
    [at] = tensors
    index = value_of(expanded[at])
    if (
        at == dim
        or not isinstance(index, torch.Tensor)
        or index.dtype not in _INDEX_DTYPES
        or any(i != slice(None) for j, i in enumerate(expanded) if j != at)
    ):
        return None
    return dim if dim < at else dim + index.dim() - 1


def _legacy_empty(arg: Any) -> bool:
    """A 1-D tensor of size 0: ``torch.cat`` skips it, whatever the other pieces' shape."""
    return shape_of(arg) == (0,)


def _requires_grad(node: fx.Node) -> bool:
    v = value_of(node)
    return isinstance(v, torch.Tensor) and v.requires_grad


def _describe(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    where = next(reversed(stack.values()))[0] if stack else ""
    what = (
        node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
    )
    return f"op {what!r} (node {node.name}{', in ' + where if where else ''})"
