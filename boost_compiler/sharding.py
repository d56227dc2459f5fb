"""Sharding propagation: decide every value's placement and rewrite to local shapes.

One forward walk over a dynamo graph (global shapes, fake tensors). Each node
gets a :class:`~boost_compiler.placement.Placement`; a node's rule may convert
its inputs first (all-gather a shard, all-reduce a partial, slice a
replicated value) and rewrites size arguments from global to local. Four
conversions are enough, and each has the backward that keeps gradients exact
(``collectives.py``):

    P -> R   reduce_from_tp  (g)      S -> R   gather_from_tp
    R -> S   scatter_to_tp            R into a rank-varying op: copy_to_tp (f)

The last one is what makes every gradient exact without case analysis: a
replicated value that requires grad and feeds a computation whose result
differs per rank receives only a partial gradient on each rank, so ``f`` sums
it in the backward. Graph outputs are always made replicated, so what leaves a
graph (and crosses a graph break) is the global tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import collectives as C
from . import tp_ops
from ._logging import get_logger
from .detect import Bottleneck
from .errors import ShardingError
from .graph_ops import as_contraction, shape_of, value_of
from .placement import P, Placement, R, S, shard_through_view, unblock

log = get_logger(__name__)


@dataclass
class Collective:
    """One collective the rewrite inserted, for the plan and the cost model."""

    kind: str  # "all_reduce" | "all_gather" | "scatter" (no comm) | "copy" (f)
    node: str
    global_shape: tuple[Any, ...]
    dtype: torch.dtype
    forward: bool  # communicates in the forward
    backward: bool  # communicates in the backward
    reason: str = ""


@dataclass
class ShardingResult:
    params: dict[str, Placement] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)


_ELEMENTWISE_FN = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.exp,
    torch.sigmoid, torch.tanh, torch.relu, torch.where, torch.clone,
    F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.leaky_relu,
}  # fmt: skip
_ELEMENTWISE_METHOD = {
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "exp", "float", "half", "bfloat16",
    "to", "type_as", "contiguous", "clone", "silu", "sigmoid", "tanh", "relu", "masked_fill",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__", "detach",
}  # fmt: skip
_VIEW_METHOD = {"view", "reshape"}


class ShardingPropagator:
    """Rewrites ``gm`` in place for one rank of a ``p``-way tensor-parallel group.

    ``fixed`` holds parameter placements decided earlier (the model's shards
    already exist); parameters not in it are decided here, and the decisions
    are returned in :attr:`result.params`.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        param_names: dict[str, str],
        bottlenecks: list[Bottleneck],
        p: int,
        group: str,
        rank: int,
        fixed: dict[str, Placement] | None = None,
    ) -> None:
        self.gm, self.graph = gm, gm.graph
        self.param_names, self.p, self.group = param_names, p, group
        # The rank is written into rank-dependent nodes (gather/scatter slice by
        # it) so the graph text, hence the AOTAutograd cache key, differs per rank.
        self.rank = rank
        self.fixed = dict(fixed or {})
        self.role: dict[str, str] = {}
        for b in bottlenecks:
            self.role[b.down_node] = "down"
            self.role[b.up_node] = "up"
        self.env: dict[fx.Node, Placement] = {}
        self.undecided: set[fx.Node] = set()
        self.converted: dict[tuple[fx.Node, Placement], fx.Node] = {}
        self.result = ShardingResult()

    # -- entry -------------------------------------------------------------

    def run(self) -> ShardingResult:
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "output":
                self._output(node)
            elif node.op in ("call_function", "call_method"):
                self._call(node)
            else:
                self.env[node] = R
        for node in self.undecided:  # parameters only ever used replicated
            self._decide(node, R)
        for node, pl in self.env.items():  # for drawings and dumps (boost explain)
            node.meta["boost_placement"] = pl
        self.graph.lint()
        self.gm.recompile()
        return self.result

    # -- placeholders and params -------------------------------------------

    def _placeholder(self, node: fx.Node) -> None:
        fqn = self.param_names.get(node.name)
        if fqn is None:
            self.env[node] = R
        elif fqn in self.fixed:
            self.env[node] = self.fixed[fqn]
            self.result.params[fqn] = self.fixed[fqn]
        else:
            self.undecided.add(node)

    def _decide(self, node: fx.Node, placement: Placement) -> Placement:
        """Fix an undecided parameter's placement on its first use."""
        if node not in self.undecided:
            return self.env[node]
        fqn = self.param_names[node.name]
        if placement.is_shard:
            size = shape_of(node)[placement.dim]
            if size % self.p:
                raise ShardingError(
                    f"parameter {fqn!r}: dimension {placement.dim} of size {size} is not "
                    f"divisible by the tensor-parallel degree p={self.p}"
                )
        self.undecided.discard(node)
        self.env[node] = placement
        self.result.params[fqn] = placement
        return placement

    def peek(self, arg: Any) -> Placement | None:
        """The placement so far; None for a parameter not yet decided."""
        if isinstance(arg, fx.Node):
            return None if arg in self.undecided else self.env.get(arg, R)
        return R

    def placement(self, arg: Any) -> Placement:
        if isinstance(arg, fx.Node):
            if arg in self.undecided:
                return self._decide(arg, R)
            return self.env.get(arg, R)
        return R

    # -- conversions -------------------------------------------------------

    def to_replicate(self, arg: Any, user: fx.Node, reason: str = "") -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        pl = self.placement(arg)
        if pl == R:
            return arg
        key = (arg, R)
        if key not in self.converted:
            with self.graph.inserting_after(arg):
                if pl == P:
                    new = self.graph.call_function(C.reduce_from_tp, (arg, self.group))
                    kind = "all_reduce"
                else:
                    new = self.graph.call_function(
                        C.gather_from_tp, (arg, pl.dim, self.group, self.rank, self.p)
                    )
                    kind = "all_gather"
            if pl.blocks:  # rank-major after the gather; put each block back together
                gathered = new
                with self.graph.inserting_after(gathered):
                    new = self.graph.call_function(unblock, (gathered, pl.dim, pl.blocks, self.p))
                gathered.meta["example_value"] = value_of(arg)
            new.meta["example_value"] = value_of(arg)
            self.env[new] = R
            self.converted[key] = new
            self._record(kind, new, arg, fwd=True, bwd=False, reason=reason or user.name)
        return self.converted[key]

    def to_shard(self, arg: Any, dim: int, user: fx.Node) -> Any:
        pl = self.placement(arg)
        if pl == S(dim):
            return arg
        if pl != R:
            arg = self.to_replicate(arg, user, "reshard")
        key = (arg, S(dim))
        if key not in self.converted:
            with self.graph.inserting_after(arg):
                new = self.graph.call_function(
                    C.scatter_to_tp, (arg, dim, self.group, self.rank, self.p)
                )
            self.env[new] = S(dim)
            self.converted[key] = new
            if _requires_grad(arg):
                self._record("all_gather", new, arg, fwd=False, bwd=True, reason="scatter")
        return self.converted[key]

    def _copy_in(self, node: fx.Node) -> None:
        """f on every replicated input that requires grad of a rank-varying node."""
        for arg in node.all_input_nodes:
            if self.env.get(arg, R) == R and _requires_grad(arg) and arg not in self.undecided:
                key = (arg, Placement("F"))
                if key not in self.converted:
                    with self.graph.inserting_after(arg):
                        new = self.graph.call_function(C.copy_to_tp, (arg, self.group))
                    self.env[new] = R
                    self.converted[key] = new
                    self._record("all_reduce", new, arg, fwd=False, bwd=True, reason="f")
                node.replace_input_with(arg, self.converted[key])

    def _record(self, kind: str, new: fx.Node, src: fx.Node, fwd: bool, bwd: bool, reason: str):
        v = value_of(src)
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else ()
        dtype = v.dtype if isinstance(v, torch.Tensor) else torch.float32
        self.result.collectives.append(Collective(kind, new.name, shape, dtype, fwd, bwd, reason))

    def set(self, node: fx.Node, placement: Placement) -> None:
        self.env[node] = placement
        if placement != R:
            self._copy_in(node)

    # -- rules -------------------------------------------------------------

    def _call(self, node: fx.Node) -> None:
        if node.target not in _SPLITS and any(
            (pl := self.peek(a)) is not None and pl.blocks and a.name not in self.param_names
            for a in node.all_input_nodes
        ):
            return self._fallback(node)  # only a split into its blocks reads a blocked shard
        rule = self._rule_for(node)
        if rule is not None:
            rule(node)
            return
        ins = [self.placement(a) for a in node.all_input_nodes]
        if any(pl != R for pl in ins):
            self._fallback(node)
        else:
            self.env[node] = R

    def _rule_for(self, node: fx.Node) -> Callable[[fx.Node], None] | None:
        t = node.target
        if node.op == "call_function":
            if as_contraction(node, set(self.param_names)) is not None:
                return self._contraction
            if t in _ELEMENTWISE_FN:
                return self._elementwise
            if t is F.dropout:
                return self._dropout
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
            if t is torch.cat:
                return self._cat
            if t in (torch.reshape,):
                return self._view
        elif node.op == "call_method":
            if t in _ELEMENTWISE_METHOD:
                return self._elementwise
            if t in _VIEW_METHOD:
                return self._view
            if t in ("transpose", "permute", "unsqueeze", "squeeze"):
                return self._dim_move
            if t in ("chunk", "split", "repeat_interleave", "softmax"):
                return self._along_other_dim
            if t in ("matmul", "__matmul__"):
                return self._same_shard
            if t in ("mean", "sum"):
                return self._reduction
        if node.op == "call_function" and t in (torch.mean, torch.sum):
            return self._reduction
        return None

    def _fallback(self, node: fx.Node) -> None:
        msg = f"{_describe(node)}: no sharding rule, gathering its inputs (exact, slower)"
        log.warning("btp: %s", msg)
        self.result.fallbacks.append(msg)
        self._replicate_inputs(node)
        self.env[node] = R

    def _replicate_inputs(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            new = self.to_replicate(arg, node)
            if new is not arg:
                node.replace_input_with(arg, new)

    def _output(self, node: fx.Node) -> None:
        self._replicate_inputs(node)

    def _elementwise(self, node: fx.Node) -> None:
        out = shape_of(node)
        tensors = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
        if any(self.peek(a) == P for a in tensors):
            self._replicate_inputs(node)
        dims = {self._aligned(a, out) for a in tensors if (pl := self.peek(a)) and pl.is_shard}
        if out is None or not dims:
            self.env[node] = R
            return
        if len(dims) > 1 or None in dims:
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
            self.env[node] = pl if pl != P else R
            if pl == P:
                self._replicate_inputs(node)
            return
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
        if not pl.is_shard:
            return self._call_replicated(node, pl)
        idx = idx if isinstance(idx, tuple) else (idx,)
        k = _dim_after_index(idx, pl.dim, len(shape_of(src)))
        if k is None:
            return self._fallback(node)
        self.set(node, S(k))

    def _cat(self, node: fx.Node) -> None:
        tensors = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        pls = {self.placement(t) for t in tensors}
        nd = len(shape_of(node))
        if len(pls) == 1 and (pl := next(iter(pls))).is_shard and dim % nd != pl.dim:
            return self.set(node, pl)
        if pls == {R}:
            self.env[node] = R
            return
        self._fallback(node)

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
        if dims != {pl.dim}:
            return self._fallback(node)
        keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        full = shape_of(x)[pl.dim]
        fn = tp_ops.sharded_mean if node.target in ("mean", torch.mean) else tp_ops.sharded_sum
        node.op, node.target = "call_function", fn
        node.args, node.kwargs = (x, pl.dim, bool(keepdim), full, self.group), {}
        self._record("all_reduce", node, node, fwd=True, bwd=False, reason="reduction")
        self.env[node] = R


_SPLITS = ("chunk", "split", torch.split, torch.chunk)
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
