"""Where ``f`` (``copy_to_tp``) goes for a replicated input of a rank-varying node.

``f`` is the identity forward and all-reduces the gradient backward: the ranks' parts of
the gradient of a replicated value read by rank-varying work are summed there. Invariant:
``f`` sits on the input itself, unless that input is made from a smaller replicated value
by a chain that only selects or moves its elements (an index gather by replicated
indices, views, float casts) and whose every link feeds only the next: then ``f`` sits on
the chain's source, read by the chain's first link alone. The gradient reaching the
source through the chain is still only this reader's parts (each link is linear and has
no other reader), so summing it there is the same sum, of fewer elements: a MoE block's
experts read ``k`` rows per token gathered from the hidden, and their gradient is summed
over ``[N, H]``, not ``[N k, H]``. The planner prices ``f`` and the applier inserts it
through this one function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from ..ir.op_table import op_kind
from ..ir.ops import value_of
from .placement import Placement, R
from .rules.core import is_cast, requires_grad

# Ops whose gradient w.r.t. their first input only moves or selects elements.
_MOVES = {"getitem", "view", "reshape", "flatten", "unsqueeze", "squeeze", "contiguous", "clone"}


def copy_site(
    arg: fx.Node, reader: fx.Node, read_as: Callable[[fx.Node, fx.Node], Placement]
) -> tuple[fx.Node, fx.Node]:
    """``(node, input)``: ``f`` goes on ``input`` where ``node`` reads it.

    ``read_as(node, src)``: the placement ``node`` reads its input ``src`` as.
    """
    site = (reader, arg)
    user, node = reader, arg
    while _moves_first_input(node) and len(node.users) == 1:
        src = node.args[0]
        if read_as(node, src) != R or not requires_grad(src):
            break
        user, node = node, src
        if _numel(node) < _numel(site[1]):
            site = (user, node)
    return site


def _moves_first_input(node: fx.Node) -> bool:
    kind = op_kind(node)
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or not isinstance(value_of(src), torch.Tensor):
        return False
    if kind == "cast":
        out = value_of(node)
        return is_cast(node) and value_of(src).is_floating_point() and out.is_floating_point()
    others = [a for a in node.all_input_nodes if a is not src]
    return kind in _MOVES and not any(requires_grad(a) for a in others)


def _numel(node: fx.Node) -> int | float:
    v = value_of(node)
    n = v.numel() if isinstance(v, torch.Tensor) else None
    return n if isinstance(n, int) else float("inf")
