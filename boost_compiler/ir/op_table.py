"""The op table: every spelling of an op in a dynamo graph -> one canonical op kind.

Dynamo writes one op several ways: ``x * y`` is ``operator.mul``, ``torch.mul``
is itself, ``x.mul(y)`` a ``call_method`` named ``"mul"`` (or ``"__mul__"``,
``"__rmul__"``). Invariant: the compiler asks what a node computes only through
:func:`op_kind`, so every spelling of a kind is treated alike everywhere
(detection, sharding rules, passes, drawings), and supporting a new spelling is
one entry here (:func:`add_spelling`), never an edit of a consumer's op set.
A kind is an op's meaning, not a rule family: ``"view"`` and ``"reshape"`` are
two kinds that happen to share a sharding rule. In-place spellings (``mul_``)
are absent on purpose: ``functionalize`` rewrites them before anything reads
the table, except the one input write it appends (``"copy_"``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._ops import OpOverload, OpOverloadPacket

# kind -> spellings: strings are ``call_method`` names, anything else a ``call_function`` target.
SPELLINGS: dict[str, tuple[Any, ...]] = {
    # arithmetic
    "add": (operator.add, torch.add, "add", "__add__", "__radd__"),
    "sub": (operator.sub, torch.sub, "sub", "__sub__"),
    "mul": (operator.mul, torch.mul, "mul", "__mul__", "__rmul__"),
    "div": (operator.truediv, torch.div, "div", "__truediv__"),
    "neg": (operator.neg, torch.neg, "neg"),
    "pow": (operator.pow, torch.pow, "pow"),
    "square": (torch.square, "square"),
    "rsqrt": (torch.rsqrt, "rsqrt"),
    "exp": (torch.exp, "exp"),
    # activations
    "sigmoid": (torch.sigmoid, F.sigmoid, "sigmoid"),
    "tanh": (torch.tanh, F.tanh, "tanh"),
    "relu": (torch.relu, F.relu, "relu"),
    "silu": (F.silu, "silu"),
    "gelu": (F.gelu,),  # F.gelu is torch._C._nn.gelu
    "leaky_relu": (F.leaky_relu,),
    "elu": (F.elu,),
    "mish": (F.mish,),
    "hardswish": (F.hardswish,),
    "dropout": (F.dropout,),
    # a custom autograd.Function's apply: dynamo traces its forward and backward as bodies
    "autograd_function_apply": (torch.ops.higher_order.autograd_function_apply,),
    # comparisons and selection
    "gt": (operator.gt, torch.gt, "gt"),
    "lt": (operator.lt, torch.lt, "lt"),
    "ge": (operator.ge, torch.ge, "ge"),
    "le": (operator.le, torch.le, "le"),
    "eq": (operator.eq, torch.eq, "eq"),
    "ne": (operator.ne, torch.ne, "ne"),
    "where": (torch.where,),
    "masked_fill": ("masked_fill",),
    # copies, casts, new tensors shaped like an input
    "clone": (torch.clone, "clone"),
    "detach": ("detach",),
    "contiguous": ("contiguous",),
    "view_as_complex": (torch.view_as_complex,),
    "view_as_real": (torch.view_as_real,),
    "cast": ("to", "float", "half", "bfloat16", "double", "type", "long", "int", "bool"),
    "type_as": ("type_as",),
    "zeros_like": (torch.zeros_like,),
    "ones_like": (torch.ones_like,),
    "full_like": (torch.full_like,),
    "empty_like": (torch.empty_like,),
    # x.new_*(sizes): HF's DeepSeek-V3 builds its keys in one (``expand_kv``)
    "new_empty": ("new_empty",),
    "new_zeros": ("new_zeros",),
    "new_ones": ("new_ones",),
    "new_full": ("new_full",),
    # contractions
    "linear": (F.linear,),  # F.linear is torch._C._nn.linear
    "matmul": (torch.matmul, operator.matmul, "matmul", "__matmul__"),
    "mm": (torch.mm, "mm"),
    "bmm": (torch.bmm,),
    "baddbmm": (torch.baddbmm, "baddbmm"),
    "addmm": (torch.addmm,),
    "sdpa": (F.scaled_dot_product_attention,),
    "embedding": (F.embedding,),
    # views and layout
    "view": ("view",),
    "view_as": ("view_as",),
    "reshape": (torch.reshape, "reshape"),
    "flatten": (torch.flatten, "flatten"),
    "unflatten": (torch.unflatten, "unflatten"),
    "transpose": ("transpose",),
    # The three agree on the 2-D weights (the compiler reads no other ``t``); on more
    # dims ``mT`` swaps the last two and ``T`` reverses them all (``rules/views.py``).
    "t": ("t", "T", "mT"),
    "permute": ("permute",),
    "unsqueeze": ("unsqueeze",),
    "squeeze": ("squeeze",),
    "expand": ("expand",),
    "broadcast_to": (torch.broadcast_to, "broadcast_to"),
    "repeat_interleave": ("repeat_interleave",),
    "repeat": ("repeat", "tile", torch.tile),
    # slicing and joining
    "getitem": (operator.getitem,),
    "split": (torch.split, "split"),
    "chunk": (torch.chunk, "chunk"),
    "unbind": (torch.unbind, "unbind"),
    "cat": (torch.cat,),
    "stack": (torch.stack,),
    "slice_scatter": (torch.slice_scatter,),
    "select_scatter": (torch.select_scatter,),
    "copy_": ("copy_",),
    # reductions, norms, losses
    "sum": (torch.sum, "sum"),
    "mean": (torch.mean, "mean"),
    "softmax": (torch.softmax, F.softmax, "softmax"),
    "rms_norm": (torch.rms_norm, F.rms_norm),
    "layer_norm": (torch.layer_norm, F.layer_norm),
    "cross_entropy": (F.cross_entropy,),
}
# ``getattr(x, "T")``: dynamo's spelling of an attribute read (its args name the attribute).
_ATTRIBUTES = {"T": "t", "mT": "t"}

_FUNCTIONS: dict[Any, str] = {}
_METHODS: dict[str, str] = {}
# ``torch.library`` ops by qualified name (``"ns::op"``), for a library that registers its
# ops only when imported (transformers' MoE kernels come with the model, after this table).
_LIBRARY: dict[str, str] = {}


def add_spelling(kind: str, *spellings: Any) -> None:
    """Make ``spellings`` (``call_function`` targets, or method names as strings) mean ``kind``.

    The public way to teach the compiler an op (a ``torch.library`` custom op's
    overload, a function marked ``allow_in_graph``); a spelling already taken by
    another kind is an error, since one node computes one thing.
    """
    for s in spellings:  # all checked before any is added: a refused call changes nothing
        taken = (_METHODS if isinstance(s, str) else _FUNCTIONS).get(s, kind)
        if taken != kind:
            raise ValueError(f"{s!r} already spells op kind {taken!r}, not {kind!r}")
    for s in spellings:
        (_METHODS if isinstance(s, str) else _FUNCTIONS)[s] = kind
    known = SPELLINGS.get(kind, ())
    SPELLINGS[kind] = (*known, *(s for s in spellings if s not in known))


def add_library_op(kind: str, *names: str) -> None:
    """Make the ``torch.library`` ops named ``names`` (``"ns::op"``, any overload) mean ``kind``.

    For ops of a library that may not be loaded yet when the rules register (the op
    object does not exist until then, so :func:`add_spelling` cannot name it).
    """
    for name in names:
        taken = _LIBRARY.get(name, kind)
        if taken != kind:
            raise ValueError(f"{name!r} already spells op kind {taken!r}, not {kind!r}")
    _LIBRARY.update(dict.fromkeys(names, kind))


for _kind, _spellings in list(SPELLINGS.items()):
    add_spelling(_kind, *_spellings)


def op_kind(node: Any) -> str | None:
    """The canonical kind of what ``node`` computes; None for anything the table lacks."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return _METHODS.get(node.target)  # type: ignore[arg-type]
    if node.op != "call_function":
        return None
    if node.target is getattr and len(node.args) == 2:
        return _ATTRIBUTES.get(node.args[1])  # type: ignore[arg-type]
    try:
        found = _FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable target is no spelling of anything
        return None
    if found is None and isinstance(node.target, (OpOverload, OpOverloadPacket)):
        return _LIBRARY.get(_qualified_name(node.target))
    return found


def _qualified_name(op: OpOverload | OpOverloadPacket) -> str:
    """``"ns::op"`` of an op or of one of its overloads."""
    return op._qualified_op_name if isinstance(op, OpOverloadPacket) else op._schema.name


def function_spellings(kind: str) -> tuple[Any, ...]:
    """The ``call_function`` targets of ``kind`` (for code that matches on targets)."""
    return tuple(s for s in SPELLINGS.get(kind, ()) if not isinstance(s, str))


def all_spellings() -> dict[Any, str]:
    """Every spelling -> its kind (method names as strings), for checks and reports."""
    return {**_FUNCTIONS, **_METHODS, **_LIBRARY}


@contextmanager
def spellings_scope() -> Iterator[None]:
    """Undo, on exit, every spelling added inside (tests that teach the table a toy op)."""
    saved = dict(SPELLINGS), dict(_FUNCTIONS), dict(_METHODS), dict(_LIBRARY)
    try:
        yield
    finally:
        for table, old in zip((SPELLINGS, _FUNCTIONS, _METHODS, _LIBRARY), saved, strict=True):
            table.clear()
            table.update(old)  # type: ignore[attr-defined]
