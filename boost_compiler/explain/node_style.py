"""What a drawing says about one node: its layer group, placement category, fill colour,
collective payload text and checkpointing mark, read off the node's metadata.

Layers are module paths up to the first numeric component (``layers.3``, ``h.0``); nodes the
passes insert (no ``nn_module_stack``) join the layer of their first input. Placements come
from ``node.meta["boost_placement"]``. :mod:`.draw` builds the DOT views from these.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from ..ir.op_table import op_kind
from ..ir.ops import value_of
from ..tp import collectives as C
from ..tp.collectives import Collective
from ..tp.placement import Placement

PLACEMENT_META = "boost_placement"
INPUTS, OUTPUTS, TOP = "(inputs)", "(outputs)", "(top level)"

# category -> (fill colour, legend text)
CATEGORIES: dict[str, tuple[str, str]] = {
    "replicated-r": ("#fde68a", "replicated, rank-r latent"),
    "replicated": ("#e5e7eb", "replicated"),
    "hidden-shard": ("#bbf7d0", "hidden/head shard S(k)"),
    "partial": ("#fdba74", "partial sum P"),
    "unplaced": ("#ffffff", "no placement recorded (before btp, or new node)"),
}
COLLECTIVE_FILL = {"fwd": "#7c3aed", "bwd": "#c4b5fd", "fwd+bwd": "#5b21b6", "none": "#ede9fe"}
CHAIN_COLOUR = "#2563eb"
RECOMPUTE_COLOUR = "#db2777"
SAVED_COLOUR = "#047857"
# Targets that are nothing but a collective (the primitives of tp/collectives.py, not the
# kernels that also compute): drawn as one hexagon themselves.
PRIMITIVES = frozenset(fn for fn in C.COMMUNICATION if fn.__module__ == C.__name__)
_DTYPE_SHORT = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32",
}  # fmt: skip


# -- text helpers --------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def collective_bytes(c: Collective) -> int:
    """Payload bytes (the size of the reduced / gathered tensor, the cost model's convention)."""
    return c.nbytes


def direction(c: Collective) -> str:
    return {(True, True): "fwd+bwd", (True, False): "fwd", (False, True): "bwd"}.get(
        (c.forward, c.backward), "none"
    )


def payload_text(c: Collective) -> str:
    """``[2, 16, 16] fp32``: what a drawing and a table print for a collective's payload."""
    return f"{list(int(x) for x in c.global_shape)} {dtype_name(c.dtype)}"


def quote(text: str) -> str:
    """A DOT string literal; ``\\n`` in ``text`` becomes a centred line break."""
    lines = str(text).split("\n")
    esc = [ln.replace("\\", "\\\\").replace('"', '\\"') for ln in lines]
    return '"' + "\\n".join(esc) + '"'


def dot_attrs(**kw: Any) -> str:
    parts = [f"{k.rstrip('_')}={quote(v)}" for k, v in kw.items() if v is not None and v != ""]
    return "[" + ", ".join(parts) + "]"


def shape_text(node: fx.Node) -> str:
    v = value_of(node)
    if isinstance(v, torch.Tensor):
        return str(list(v.shape)).replace(" ", "")
    if isinstance(v, (tuple, list)):
        return f"({len(v)} values)"
    return ""


# -- layer assignment ------------------------------------------------------------

_STACK_TOKEN = re.compile(
    r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*|\d+)|\[(\d+)\]|\['([^']+)'\]"
)


def stack_path(source: str) -> str:
    """``L['self'].layers[0]._modules['attn']`` or ``L['self'].layers.0.attn`` -> ``layers.0.attn``."""
    head = re.match(r"L\['[^']+'\]", source)
    start = head.end() if head else 0
    parts = [
        next(g for g in m.groups() if g is not None) for m in _STACK_TOKEN.finditer(source, start)
    ]
    return ".".join(parts)


def group_of_path(path: str) -> str:
    """The layer a module path belongs to: up to its first numeric part, else its first part."""
    parts = [p for p in path.split(".") if p]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else TOP


def is_layer(group: str) -> bool:
    return any(p.isdigit() for p in group.split("."))


def assign_groups(
    graph: fx.Graph, param_names: Mapping[str, str], buffer_names: Mapping[str, str] | None = None
) -> dict[fx.Node, str]:
    """Every node's layer (see the module docstring)."""
    names = {**(buffer_names or {}), **param_names}
    out: dict[fx.Node, str] = {}
    order: dict[str, int] = {}  # a group's first appearance
    for node in graph.nodes:
        if node.op == "placeholder":
            fqn = names.get(node.name)
            group = group_of_path(fqn.rsplit(".", 1)[0]) if fqn and "." in fqn else INPUTS
        elif node.op == "output":
            group = OUTPUTS
        elif stack := node.meta.get("nn_module_stack") or {}:
            entry = list(stack.values())[-1]
            path = entry[0] if isinstance(entry, (tuple, list)) else str(entry)
            group = group_of_path(stack_path(str(path)))
        else:
            # Inserted by a pass: the latest layer among its inputs (a value computed
            # from layer i-1's residual and layer i's weights belongs to layer i).
            inherited = [out[a] for a in node.all_input_nodes if out[a] != INPUTS]
            group = max(inherited, key=order.__getitem__) if inherited else TOP
        out[node] = group
        order.setdefault(group, len(order))
    return out


# -- placements ----------------------------------------------------------------


def placement_of(node: fx.Node) -> Placement | None:
    """The placement the planner gave ``node``, or a structural guess for
    nodes later passes inserted (collective outputs are replicated, a reduce's input is
    partial, a piece of a value keeps its placement); None when unknown."""
    pl = node.meta.get(PLACEMENT_META)
    if isinstance(pl, Placement):
        return pl
    if node.op == "call_function" and node.target in (C.reduce_from_tp, C.copy_to_tp):
        return Placement("R")
    if node.op == "call_function" and node.target is C.gather_from_tp:
        return Placement("R")
    users = list(node.users)
    if users and all(u.op == "call_function" and u.target is C.reduce_from_tp for u in users):
        return Placement("P")
    if op_kind(node) == "getitem":
        src = node.args[0]
        if isinstance(src, fx.Node) and isinstance(src.meta.get(PLACEMENT_META), Placement):
            return src.meta[PLACEMENT_META]
    return None


def category(node: fx.Node, ranks: set[int]) -> str:
    pl = placement_of(node)
    if pl is None:
        return "unplaced"
    if pl.kind == "P":
        return "partial"
    if pl.is_shard:
        return "hidden-shard"
    v = value_of(node)
    if isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] in ranks:
        return "replicated-r"
    return "replicated"


def checkpointing(node: fx.Node) -> tuple[str, Any] | None:
    """``("recompute" | "saved", region)`` from the activation-checkpointing tags
    (``node.meta["recompute"]``: a ``CheckpointPolicy`` or a bool, ``ac_graph_id``)."""
    policy = node.meta.get("recompute")
    if policy is None or policy is False:
        return None
    name = str(getattr(policy, "name", policy)).upper()
    return ("saved" if "SAVE" in name else "recompute", node.meta.get("ac_graph_id"))
