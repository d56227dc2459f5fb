"""Pass ``group_linears``: sibling factors share one GEMM and one collective.

Invariant: the graph computes the same values and gradients; only how the
sibling factors are batched (and, under ``btp``, how their collectives are
merged) changes.

* Down factors reading one input (q/k/v after the attention norm, gate/up
  after the MLP norm) become ONE GEMM on the concatenated weights. Under
  ``btp`` they are row-parallel: the concatenated partial goes through ONE
  all-reduce of ``[..., r_q + r_k + r_v]`` and is split after it.
* The up factors of those siblings read their replicated inputs through ONE
  ``copy_to_tp`` of the concatenated latents, so the backward all-reduces of
  ``dL/dh`` merge the same way. Up factors whose weights have one shape run
  as one ``bmm`` on stacked weights (:func:`boost_compiler.tp.sharded_ops.batched_linear`).

What Inductor already does: its ``batch_linear``/``batch_linear_lhs`` pre-grad
fusions (TORCH_NOTES) batch same-shape linears, including ones sharing an
input, but they run after this backend's rewrite and know nothing of the
collectives between the factors. Merging the all-reduces, forward and
backward, is what this pass adds; the GEMM batching comes with it because the
merged collective's input must be one tensor anyway.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from .._logging import get_logger
from ..ir.ops import value_of
from ..tp import collectives as C
from ..tp import sharded_ops as tp_ops
from ._rewrite import (
    LINEAR,
    MATMUL,
    bias_arg,
    finish,
    is_copy,
    last_size,
    reduce_of,
    split_uses,
    weight_arg,
)
from .base import BoostPass

log = get_logger(__name__)


class GroupLinears(BoostPass):
    name = "group_linears"
    depends_on = ("boost_compiler.passes._rewrite", "boost_compiler.tp.sharded_ops")

    def run(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        assert gm is not None
        tp = self.ctx.tp
        ups_of = {b.down_node: b.up_node for b in self.ctx.bottlenecks}
        by_name = {n.name: n for n in graph.nodes}
        groups = 0
        for x, downs in _siblings(graph, set(ups_of), tp is not None).items():
            ups = [by_name[ups_of[d.name]] for d in downs if ups_of[d.name] in by_name]
            if not _group_downs(graph, x, downs, tp):
                continue
            groups += 1
            if len(ups) == len(downs) and _independent(ups):
                _group_ups(graph, ups, tp)
        if groups:
            finish(gm)
        log.info("group_linears: %d group(s) of sibling factors", groups)


def _siblings(graph: fx.Graph, downs: set[str], tp: bool) -> dict[fx.Node, list[fx.Node]]:
    """Down factors (by input) that can be concatenated: plain linear/matmul, one layout."""
    found: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.name not in downs or weight_arg(node) is None:
            continue
        if tp and reduce_of(node) is None:
            continue
        found[node.args[0]].append(node)
    out = {}
    for x, members in found.items():
        kinds = {m.target in LINEAR for m in members}
        biased = {bias_arg(m) is not None for m in members}
        if len(members) > 1 and len(kinds) == 1 and len(biased) == 1:
            out[x] = members
    return out


def _group_downs(graph: fx.Graph, x: fx.Node, downs: list[fx.Node], tp: object) -> bool:
    """One GEMM (and under tp one all-reduce); False when the group cannot be formed."""
    sizes = [last_size(d) for d in downs]
    if None in sizes:
        return False
    first = downs[0]
    is_linear = first.target in LINEAR
    with graph.inserting_before(first):
        w = graph.call_function(torch.cat, ([weight_arg(d) for d in downs], 0 if is_linear else 1))
        if is_linear:
            bias = None
            if bias_arg(first) is not None:
                bias = graph.call_function(torch.cat, ([bias_arg(d) for d in downs], 0))
            y = graph.call_function(first.target, (x, w, bias))
        else:
            y = graph.call_function(first.target, (x, w))
    y.meta["example_value"] = _cat_values(downs)
    if tp is None:
        split_uses(graph, y, sizes, downs)
        _erase(graph, downs)
        return True
    reduces = [reduce_of(d) for d in downs]
    with graph.inserting_after(y):
        reduced = graph.call_function(C.reduce_from_tp, (y, reduces[0].args[1]))
    reduced.meta["example_value"] = y.meta["example_value"]
    reduced.meta[C.WHY_META] = "grouped row-parallel"  # the plan reads the graph: say why
    split_uses(graph, reduced, sizes, reduces)
    _erase(graph, reduces + downs)
    return True


def _independent(ups: list[fx.Node]) -> bool:
    """Whether the up factors are distinct and none reads another's output.

    One concatenated input for all of them must exist before each runs: a narrow dense
    MLP (``intermediate_size`` below the hidden) makes gate and up down factors whose one
    up factor is ``down_proj`` (the same node twice), and a chain of factors would make
    one up wait for another. Either would be a cycle.
    """
    if len(set(ups)) != len(ups):
        return False
    order = {n: i for i, n in enumerate(ups[0].graph.nodes)}
    # An up batched by an earlier group is no longer in the graph (LaX shares latents).
    first = min((order[u] for u in ups if u in order), default=0)
    targets = set(ups)
    for up in ups:
        todo, seen = list(up.all_input_nodes), set()
        while todo:
            node = todo.pop()
            if node in targets:
                return False
            if node in seen or order.get(node, -1) < first:
                continue
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return True


def _group_ups(graph: fx.Graph, ups: list[fx.Node], tp: object) -> None:
    """One f for the siblings' latents; one bmm where their weights have one shape."""
    if any(weight_arg(u) is None or u.target not in LINEAR + MATMUL for u in ups):
        return
    inputs = [u.args[0] for u in ups]
    copies = [i for i in inputs if is_copy(i)]
    if tp is not None and len(copies) != len(ups):
        return
    latents = [c.args[0] for c in copies] if tp is not None else inputs
    sizes = [last_size(h) for h in latents]
    # One cat needs one leading shape: MLA's q latent is [b, s, r], its kv latent [b, 1, s, r].
    # (str: a symbolic size is not hashable, and == on it would add a guard)
    if None in sizes or len({str(tuple(value_of(h).shape[:-1])) for h in latents}) != 1:
        return
    last = max(ups, key=_position)
    with graph.inserting_before(last):
        cat = graph.call_function(torch.cat, (latents, -1))
        whole = graph.call_function(C.copy_to_tp, (cat, copies[0].args[1])) if copies else cat
        parts = graph.call_function(torch.split, (whole, sizes, -1))
    cat.meta["example_value"] = whole.meta["example_value"] = _cat_values(latents)
    if whole is not cat:
        whole.meta[C.WHY_META] = "grouped column-parallel (f)"
    pieces = []
    for i, up in enumerate(ups):
        with graph.inserting_before(last):
            pieces.append(graph.call_function(operator.getitem, (parts, i)))
        up.replace_input_with(up.args[0], pieces[-1])
    _batch_same_shape(graph, ups, pieces, last)
    for c in copies:
        if not c.users:
            graph.erase_node(c)


def _batch_same_shape(
    graph: fx.Graph, ups: list[fx.Node], pieces: list[fx.Node], before: fx.Node
) -> None:
    """Same-shape F.linear up factors -> one ``tp_ops.batched_linear`` (a bmm)."""
    shapes: dict[tuple, list[int]] = defaultdict(list)
    for i, up in enumerate(ups):
        w = value_of(weight_arg(up))
        if up.target in LINEAR and isinstance(w, torch.Tensor):
            shapes[(tuple(w.shape), w.dtype, bias_arg(up) is not None)].append(i)
    for members in shapes.values():
        if len(members) < 2:
            continue
        group = [ups[i] for i in members]
        biases = [bias_arg(u) for u in group] if bias_arg(group[0]) is not None else None
        with graph.inserting_before(before):
            out = graph.call_function(
                tp_ops.batched_linear,
                ([pieces[i] for i in members], [weight_arg(u) for u in group], biases),
            )
        for j, up in enumerate(group):
            with graph.inserting_before(before):
                item = graph.call_function(operator.getitem, (out, j))
            up.replace_all_uses_with(item)
            graph.erase_node(up)


def _cat_values(nodes: list[fx.Node]) -> object:
    """The value of the nodes concatenated on the last dim: the payload the plan reads off
    a merged collective, and the shapes later passes read."""
    values = [value_of(n) for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    fake_mode = getattr(values[0], "fake_mode", None)
    if fake_mode is None or any(getattr(v, "fake_mode", None) is not fake_mode for v in values):
        # No common fake mode (meta values): only shape, dtype and requires_grad matter.
        v = values[0]
        shape = (*v.shape[:-1], sum(x.shape[-1] for x in values))
        return torch.empty(shape, dtype=v.dtype, device="meta", requires_grad=v.requires_grad)
    with fake_mode:
        return torch.cat(values, -1)


def _position(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for n in nodes:
        if not n.users:
            graph.erase_node(n)
