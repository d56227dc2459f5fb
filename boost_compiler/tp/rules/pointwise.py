"""Sharding rules of element-wise ops: arithmetic, activations, casts, comparisons, dropout.

Invariant: an element-wise op computes each output element from the aligned
elements of its (broadcast) inputs, so every rank computes its own shard of the
output from its shards of the inputs, and a replicated operand is sliced to
the same shard (no communication) unless it broadcasts along the shard dim.
Inputs sharded on different output dims cannot be combined locally: they fall
back. Dropout is the one op here whose values are random; it draws an
independent mask per shard.
"""

from __future__ import annotations

import torch.fx as fx

from ...ir.ops import shape_of
from .. import kernels as tp_ops
from ..placement import P, R, S
from .core import aligned, tensor_inputs
from .registry import Propagator, rule

ELEMENTWISE = (
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "exp",
    "sigmoid", "tanh", "relu", "silu", "gelu", "leaky_relu",
    "gt", "lt", "ge", "le", "eq", "ne", "where", "masked_fill",
    "clone", "detach", "contiguous", "cast", "type_as",
    "zeros_like", "ones_like", "full_like", "empty_like",
)  # fmt: skip


# always: with no input sharded a parameter operand stays undecided (peek), so a
# later shard can still decide it (a norm weight multiplied in after the norm).
@rule(*ELEMENTWISE, always=True)
def elementwise(prop: Propagator, node: fx.Node) -> None:
    out = shape_of(node)
    tensors = tensor_inputs(node)
    if any(prop.peek(a) == P for a in tensors):
        prop._replicate_inputs(node)
    dims = {aligned(prop, a, out) for a in tensors if (pl := prop.peek(a)) and pl.is_shard}
    if not dims:
        prop.env[node] = R
        return
    # None: a sharded input of an op with no tensor output (``torch.where(mask)``'s
    # index tuple): gathered, never called replicated on a shard.
    if out is None or len(dims) > 1 or None in dims:
        return prop._fallback(node)
    [k] = dims
    nd = len(out)
    for a in tensors:
        s = shape_of(a) or ()
        j = k - (nd - len(s))  # the operand's dim aligned to output dim k
        if j < 0 or s[j] == 1:
            continue  # broadcast along the sharded dim: use it whole
        if a in prop.undecided:
            prop._decide(a, S(j))
        elif prop.peek(a) == R:
            node.replace_input_with(a, prop.to_shard(a, j, node))
    prop.set(node, S(k))


@rule("dropout")
def dropout(prop: Propagator, node: fx.Node) -> None:
    """Sharded input: :func:`tp_ops.sharded_dropout`, independent masks per shard.

    (A replicated input keeps plain dropout: synchronised RNG streams give
    every rank one mask.)
    """
    names = ("input", "p", "training", "inplace")
    bound = {"p": 0.5, "training": True, **dict(zip(names, node.args, strict=False))}
    bound.update(node.kwargs)
    x = bound["input"]
    pl = prop.placement(x)
    node.target = tp_ops.sharded_dropout
    node.args = (x, bound["p"], bound["training"], pl.dim, prop.rank, prop.p)
    node.kwargs = {}
    prop.set(node, pl)
