"""Pass ``checkpoint``: communication-free low-rank activation checkpointing.

Invariant: values and gradients are unchanged; only which forward values
AOTAutograd's min-cut partitioner saves for the backward (and which it
recomputes there) changes, through ``node.meta["recompute"]`` /
``node.meta["ac_graph_id"]`` on the dynamo graph (TORCH_NOTES: the tags are
inherited by every aten node decomposed from a tagged node).

``True`` (or ``"lowrank"``): inside each transformer layer, every node that
communicates in its forward (the r-dim all-reduces, the fused online-norm
all-reduce, norm statistics, gathers) is ``MUST_SAVE``: its narrow, replicated
output is kept and never recomputed, so the backward runs exactly the
collectives it runs without checkpointing. Everything else is
``PREFER_RECOMPUTE``, in regions cut at those collectives (a new
``ac_graph_id`` after each), so the partitioner keeps what crosses a region
boundary (the hidden-shard residual stream) and recomputes the rest from it:
shard-local work only.

``"full"``: every node of a layer, collectives included, is recomputed: the
usual whole-layer activation checkpointing, which re-runs the forward
collectives in the backward. Offered to compare against.

Layers are found from ``nn_module_stack`` (the first ``<name>.<index>`` module
path, e.g. ``layers.3``); nodes a pass inserted inherit the layer of their
inputs. Nodes outside layers (embedding, final norm, LM head) are untouched.
The tags are metadata, which Inductor's and AOTAutograd's cache keys do not
see; the pass's uuid (its setting included) is folded into those keys by the
backend, so a warm cache never returns an untagged graph for a tagged request.
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .._logging import get_logger
from ..ir.op_table import op_kind
from ..ir.subgraphs import body_of, inline_all
from ..tp import collectives as C
from .base import BoostPass

log = get_logger(__name__)

_LAYER = re.compile(r"^(.*?[.\[]\d+\]?)(?:[.\[]|$)")


class Checkpoint(BoostPass):
    name = "checkpoint"
    default = False
    allowed = ("lowrank", "full")
    depends_on = ("boost_compiler.tp.sharded_ops", "boost_compiler.tp.collectives")

    def run(self, graph: fx.Graph) -> None:
        mode = "lowrank" if self.setting is True else self.setting
        if mode is False:
            return
        layers = layer_of_nodes(graph)
        order = {name: i for i, name in enumerate(dict.fromkeys(layers.values()))}
        region = 0
        saved = recomputed = 0
        current = None
        for node in graph.nodes:
            layer = layers.get(node)
            if layer is None or node.op not in ("call_function", "call_method"):
                continue
            if layer != current:  # a layer's output is a region boundary, collective or not
                region, current = region + 1, layer
            if mode == "full":
                _tag(node, CheckpointPolicy.PREFER_RECOMPUTE, order[layer])
                recomputed += 1
            elif is_communicating(node):
                _tag(node, CheckpointPolicy.MUST_SAVE, region)
                region += 1
                saved += 1
            else:
                _tag(node, CheckpointPolicy.PREFER_RECOMPUTE, region)
                recomputed += 1
        log.info(
            "checkpoint(%s): %d layer(s), %d collective node(s) saved, %d node(s) recomputable",
            mode, len(order), saved, recomputed,
        )  # fmt: skip


def inline_tagged_regions(gm: fx.GraphModule) -> int:
    """Inline every nested compile region, each call's recompute regions kept its own.

    Why inline: a checkpointed body recomputes a random op in its backward (the CPU
    SDPA kernel is ``nondeterministic_seeded`` even without dropout), and torch 2.13's
    partitioner then threads the random state from the body's forward to its backward
    through ``run_and_save_rng_state``, whose fake implementation returns the real
    ``torch.get_rng_state()``: the caller's compile fails with "Please convert all
    Tensors to FakeTensors first" (or, on a cold cache, an ``ObjMismatchError`` while
    hashing it). Inlined, the partitioner sees one graph, as for a model without blocks.
    Every call's copies get ``ac_graph_id``s above those of the graph and of the calls
    before it: each block's regions stay distinct, so their boundaries are still saved.
    Returns how many calls were inlined.
    """
    base = 1 + max((_graph_id(n) for n in gm.graph.nodes), default=0)

    def tag_for(call: fx.Node) -> Any:
        nonlocal base
        offset = base
        base += 1 + max((_graph_id(n) for n in body_of(call).graph.nodes), default=0)

        def tag(node: fx.Node) -> None:
            if "ac_graph_id" in node.meta:
                node.meta["ac_graph_id"] += offset

        return tag

    return inline_all(gm, tag_for)


def _graph_id(node: fx.Node) -> int:
    return int(node.meta.get("ac_graph_id", 0))


def is_communicating(node: fx.Node) -> bool:
    """Whether the node's forward communicates (the table of tp/collectives.py says)."""
    if node.op != "call_function":
        return False
    if C.forward_communicating(node):
        return True
    # An element of a multi-output collective (the fused online-norm result).
    src = node.args[0] if node.args else None
    return op_kind(node) == "getitem" and isinstance(src, fx.Node) and C.forward_communicating(src)


def layer_of_nodes(graph: fx.Graph) -> dict[fx.Node, str]:
    """Each node's layer (``"...layers.3"``), from its module stack or its inputs."""
    out: dict[fx.Node, str] = {}
    for node in graph.nodes:
        layer = _layer_from_stack(node.meta.get("nn_module_stack"))
        if layer is None and not node.meta.get("nn_module_stack"):
            layer = next((out[a] for a in node.all_input_nodes if a in out), None)
        if layer is not None:
            out[node] = layer
    return out


def _layer_from_stack(stack: dict[str, Any] | None) -> str | None:
    for path, _ in (stack or {}).values():
        m = _LAYER.match(str(path))
        if m:
            return m.group(1)
    return None


def _tag(node: fx.Node, policy: CheckpointPolicy, graph_id: int) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = graph_id
