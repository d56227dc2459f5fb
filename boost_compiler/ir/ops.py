"""What a dynamo-graph node computes, in the terms the analysis needs.

Two questions matter for bottleneck detection: is a node a *contraction with a
parameter* (which parameter, which dimension goes in and out), and is it
*element-wise on the last dimension* (so a rank-r activation stays rank-r and
every position of the last dim is computed on its own). Both are answered from
the op and the fake-tensor shapes, never from module or parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .op_table import op_kind


def value_of(node: Any) -> Any:
    """The fake (or meta) value dynamo or AOT recorded for a node."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node: Any) -> tuple[Any, ...] | None:
    v = value_of(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def last_dim(node: Any) -> Any:
    shape = shape_of(node)
    return shape[-1] if shape else None


def op_name(node: fx.Node) -> str:
    """A short, stable name for reports: ``silu``, ``to``, ``add``, ``linear``."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).lstrip("_")
    if node.op == "call_module":
        return str(node.target)
    return node.op


# --- contractions ---------------------------------------------------------

_CONTRACTIONS = {"linear", "matmul", "mm", "addmm"}
# Ops through which a weight still "is" the parameter (dtype casts, views of
# the same matrix). A transpose flips which side is d_in.
_WEIGHT_CASTS = {"cast", "type_as", "contiguous"}


@dataclass(frozen=True)
class Contraction:
    """``out = contract(input, weight)`` over the input's last dimension."""

    node: fx.Node
    input: fx.Node
    weight: fx.Node  # the placeholder holding the parameter
    d_in: int
    d_out: int
    bias: fx.Node | None = None
    weight_layout: str = "out_in"  # "out_in" (nn.Linear) or "in_out" (x @ W)


def _weight_placeholder(node: Any, params: set[str]) -> tuple[fx.Node, bool] | None:
    """Follow casts/transposes back to a parameter placeholder.

    Returns ``(placeholder, transposed)`` or None when the operand is not a
    parameter (an activation, e.g. attention's ``q @ k^T``).
    """
    transposed = False
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return (node, transposed) if node.name in params else None
        kind = op_kind(node)
        if kind in _WEIGHT_CASTS:
            node = node.args[0]
        elif kind == "t" or (kind == "transpose" and _is_swap_2d(node)):
            transposed = not transposed
            node = node.args[0]
        elif (masked := _masked_weight(node, params)) is not None:
            node = masked
        else:
            return None
    return None


def weight_parameter(node: Any, params: set[str]) -> fx.Node | None:
    """The parameter placeholder ``node`` reads through casts, transposes and masks; None
    for a value computed otherwise (an activation, a weight computed from parameters)."""
    found = _weight_placeholder(node, params)
    return None if found is None else found[0]


def _masked_weight(node: fx.Node, params: set[str]) -> fx.Node | None:
    """The weight operand of ``weight * mask``, a mask being a buffer (a placeholder that is
    no parameter) of the weight's own shape; else None.

    Why it still "is" the parameter: a fixed mask keeps or zeroes entries, so the product
    has the weight's shape, layout and any split of it (the mask sliced alike), and its
    gradient is the weight's, masked. It is how a sparse matrix of fixed support is held
    dense (:class:`boost_compiler.sparse.SparsePart`, SLTrain's ``S``).
    """
    if op_kind(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    for weight, mask in (node.args, node.args[::-1]):
        if (
            isinstance(weight, fx.Node)
            and isinstance(mask, fx.Node)
            and mask.op == "placeholder"
            and mask.name not in params
            and shape_of(mask) == shape_of(weight) == shape_of(node)
        ):
            return weight
    return None


def weight_step(node: fx.Node) -> str | None:
    """``"same"`` for a cast or copy of a weight, ``"transpose"`` for a 2-D transpose, else None."""
    kind = op_kind(node)
    if kind in _WEIGHT_CASTS:
        return "same"
    if (kind == "t" and len(shape_of(node) or ()) == 2) or (
        kind == "transpose" and _is_swap_2d(node)
    ):
        return "transpose"  # .mT of a 3-D stack, or .t() of a vector, is no 2-D transpose
    return None


def _is_swap_2d(node: fx.Node) -> bool:
    dims = {d % 2 for d in node.args[1:3] if isinstance(d, int)}
    return len(dims) == 2 and len(shape_of(node) or ()) == 2


# Each contraction's operands by position and keyword name: (input, weight, bias).
_OPERANDS: dict[str, tuple[tuple[int, str], tuple[int, str], tuple[int, str] | None]] = {
    "linear": ((0, "input"), (1, "weight"), (2, "bias")),
    "addmm": ((1, "mat1"), (2, "mat2"), (0, "input")),
    "matmul": ((0, "input"), (1, "other"), None),
    "mm": ((0, "input"), (1, "mat2"), None),
}


def _operand(node: fx.Node, where: tuple[int, str]) -> Any:
    pos, name = where
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name)


def contraction_operands(node: fx.Node) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of a contraction node as written (bias None where it has
    none), whether passed by position or by keyword."""
    x_at, w_at, b_at = _OPERANDS[op_kind(node) or ""]
    return _operand(node, x_at), _operand(node, w_at), None if b_at is None else (
        _operand(node, b_at))  # fmt: skip


def as_contraction(node: fx.Node, params: set[str]) -> Contraction | None:
    """Recognise ``F.linear(x, W, b)``, ``x @ W``, ``torch.matmul(x, W)``, ``addmm(b, x, W)``.

    ``params`` holds the names of placeholder nodes that are parameters. Every reader
    of the result takes it as ``x @ W (+ b)`` with ``b`` a ``[d_out]`` vector (split on
    its only dim with the output features, added after a row-parallel sum). A call that
    is not that (``addmm``'s ``beta``/``alpha`` other than 1, a bias of another shape,
    which addmm broadcasts, an ``out=``) is no contraction here: it is computed on
    whole operands, exact.
    """
    kind = op_kind(node)
    if kind not in _CONTRACTIONS or "out" in node.kwargs:
        return None
    if kind == "addmm" and any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return None
    x, w, b = contraction_operands(node)
    found = _weight_placeholder(w, params)
    if found is None or not isinstance(x, fx.Node):
        return None
    ph, transposed = found
    # nn.Linear stores [out, in]; x @ W and addmm read W as [in, out].
    layout = "out_in" if (kind == "linear") != transposed else "in_out"
    c = _make(node, x, ph, b, layout)
    if c is not None and b is not None and shape_of(b) != (c.d_out,):
        return None
    return c


def _make(node: fx.Node, x: fx.Node, ph: fx.Node, bias: Any, layout: str) -> Contraction | None:
    w_shape = shape_of(ph)
    if w_shape is None or len(w_shape) != 2:
        return None
    d_out, d_in = w_shape if layout == "out_in" else (w_shape[1], w_shape[0])
    if last_dim(x) != d_in or last_dim(node) != d_out:
        return None
    bias_node = bias if isinstance(bias, fx.Node) else None
    return Contraction(node, x, ph, int(d_in), int(d_out), bias_node, layout)


# --- element-wise ops -----------------------------------------------------

_ELEMENTWISE = {
    "silu", "gelu", "relu", "leaky_relu", "elu", "mish", "dropout", "tanh", "sigmoid",
    "hardswish", "clone", "neg", "cast", "type_as", "contiguous", "detach",
    "add", "sub", "mul", "div",
}  # fmt: skip
# Function spellings (torch.flatten(x, 0, 1)) would qualify as well; detection never
# took them, and widening it would move bottlenecks in existing plans.
_LAST_DIM_VIEW_METHODS = {"view", "reshape", "flatten", "unsqueeze"}


def is_elementwise_on_last_dim(node: fx.Node) -> bool:
    """True when every position of the output's last dim depends only on the
    same position of the inputs' last dims (broadcast operands allowed).

    Views that keep the last dimension (``x.view(-1, r)``) count too: they
    move no data across it. Norms, softmax and reductions never do.
    """
    out = shape_of(node)
    if not out:
        return False
    kind = op_kind(node)
    if kind in _ELEMENTWISE:
        return _operands_broadcast(node, out)
    if kind in _LAST_DIM_VIEW_METHODS and node.op == "call_method":
        src = shape_of(node.args[0])
        return bool(src) and src[-1] == out[-1]
    return False


def _operands_broadcast(node: fx.Node, out: tuple[Any, ...]) -> bool:
    """Tensor operands must broadcast into ``out`` along the last dim (size 1 or equal)."""
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, fx.Node) and (s := shape_of(arg)) is not None:
            if s and s[-1] not in (1, out[-1]):
                return False
            if len(s) > len(out):
                return False
    return True
