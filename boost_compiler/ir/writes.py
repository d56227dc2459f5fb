"""What an op of a dynamo graph writes, and what it aliases: the facts ``functionalize`` acts on.

Invariant: these functions only read a graph (its targets, arguments and the fake
tensors' storages); :func:`is_mutation` is true exactly for the nodes the
``functionalize`` pass rewrites, so the rules and capture can ask the same
question without importing the pass.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from .ops import value_of

_INPLACE_OPERATOR = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.imatmul: operator.matmul,
    operator.iand: operator.and_, operator.ior: operator.or_, operator.ixor: operator.xor,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}  # fmt: skip
# Methods that end in "_" but write no values (autograd flags, memory placement).
_NOT_MUTATING = {"requires_grad_", "retain_grad", "share_memory_", "record_stream"}
_RANDOM = {
    "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_",
}  # fmt: skip
# Views whose inverse is the same op (or its inverse permutation): mutations write back.
_SELF_INVERSE = {"transpose", "swapaxes", "swapdims", "t"}
_RESHAPES = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze",
             "unsqueeze", torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze}  # fmt: skip
_IDENTITY_VIEWS = {"contiguous", "to", "float", "half", "bfloat16", "double", "type", "type_as"}


def is_mutation(node: fx.Node) -> bool:
    """True when ``node`` writes into one of its inputs (what this pass removes)."""
    return _mutated_arg(node) is not None


def written_inputs(graph: fx.Graph) -> dict[int, fx.Node]:
    """Placeholders (by position) whose memory some node of ``graph`` writes into.

    With the first node that writes, for error messages. Capture uses it to run
    a recorded graph on copies of those inputs, so that analysing a model
    never changes its buffers (or the caller's tensors).
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    keys = {_storage_key(n): i for i, n in enumerate(placeholders)}
    keys.pop(None, None)
    out: dict[int, fx.Node] = {}
    for node in graph.nodes:
        target = _mutated_arg(node)
        if target is not None and (i := keys.get(_storage_key(target))) is not None:
            out.setdefault(i, node)
    return out


def describe_write(node: fx.Node) -> str:
    """The op and the user's source line of a write, for errors."""
    return _where(node)


# -- what a node is ---------------------------------------------------------


def _storage_key(node: fx.Node) -> Any:
    v = value_of(node)
    if isinstance(v, torch.Tensor):
        return StorageWeakRef(v.untyped_storage())
    if isinstance(v, (tuple, list)) and v and all(isinstance(t, torch.Tensor) for t in v):
        return StorageWeakRef(v[0].untyped_storage())
    return None


def _viewed_input(node: fx.Node) -> fx.Node | None:
    """The input whose memory ``node``'s result shares (a view of it), if any."""
    key = _storage_key(node)
    if key is None:
        return None
    for a in node.all_input_nodes:
        other = _storage_key(a)  # (StorageWeakRef.__eq__ does not take None)
        if other is not None and other == key:
            return a
    return None


def _mutated_arg(node: fx.Node) -> fx.Node | None:
    if node.op not in ("call_method", "call_function") or not node.args:
        return None
    first = node.args[0]
    if not isinstance(first, fx.Node) or _storage_key(first) is None:
        return None
    t = node.target
    if node.op == "call_method":
        if node.meta.get("boost_input_write"):
            return None  # the epilogue this pass wrote
        name = str(t)
        mutating = name.endswith("_") and not name.startswith("__") and name not in _NOT_MUTATING
        return first if mutating or name in ("__iadd__", "__isub__", "__imul__") else None
    if t in _INPLACE_OPERATOR or t is operator.setitem:
        return first
    if _inplace_flag(node):
        return first
    name = getattr(t, "__name__", "")
    if getattr(torch, name, None) is t and name.endswith("_") and not name.startswith("_"):
        return first if hasattr(torch, name[:-1]) else None
    return None


def _functional_method(name: str) -> str | None:
    if name.startswith("__i"):
        return "__" + name[3:]
    if hasattr(torch.Tensor, name[:-1]):
        return name[:-1]
    return None


def _bind(node: fx.Node) -> inspect.BoundArguments:
    return inspect.signature(node.target).bind(*node.args, **node.kwargs)


def _inplace_flag(node: fx.Node) -> bool:
    """``F.relu(x, inplace=True)`` and the other functionals with an ``inplace`` flag."""
    if node.op != "call_function" or getattr(node.target, "__module__", "") != F.__name__:
        return False
    try:
        return bool(_bind(node).arguments.get("inplace", False))
    except (TypeError, ValueError):
        return False


def _tensor_index(index: Any) -> bool:
    """Every entry of the index is a tensor (integer indices or a mask), none a slice."""
    items = index if isinstance(index, (tuple, list)) else (index,)
    return bool(items) and all(
        isinstance(i, fx.Node) and isinstance(value_of(i), torch.Tensor) for i in items
    )


def _basic_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def _index_steps(index: Any, nd: int) -> list[tuple[int, Any]] | None:
    """``x[index]`` as a sequence of one-dim selects/slices: ``[(dim, int | slice), ...]``.

    Dims count in the view each step applies to (a select removes one). None
    (new axes) are not supported on a write path; full slices are skipped.
    """
    items = index if isinstance(index, tuple) else (index,)
    if not _basic_index(items) or any(i is None for i in items):
        return None
    n_real = sum(1 for i in items if i is not Ellipsis)
    expanded: list[Any] = []
    for i in items:
        expanded.extend([slice(None)] * (nd - n_real) if i is Ellipsis else [i])
    steps, dim = [], 0
    for entry in expanded:
        if isinstance(entry, int):
            steps.append((dim, entry))
            continue
        if entry != slice(None):
            steps.append((dim, entry))
        dim += 1
    return steps or [(0, slice(None))]


def _op(node: fx.Node) -> str:
    return (
        str(node.target)
        if node.op == "call_method"
        else getattr(node.target, "__name__", str(node.target))
    )


def _where(node: fx.Node) -> str:
    """``op 'mul_' at model.py:42 (x.mul_(2.0))``: the op and the user's source line."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    where = ""
    for i in range(len(trace) - 1, -1, -1):
        line = trace[i].strip()
        if line.startswith("File "):
            parts = line.split(", ")
            file = parts[0][6:-1].rsplit("/", 1)[-1]
            lineno = parts[1].removeprefix("line ") if len(parts) > 1 else "?"
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            where = f" at {file}:{lineno} ({code})"
            break
    return f"op {_op(node)!r} (node {node.name}){where}"
