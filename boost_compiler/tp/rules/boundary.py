"""Rules of the shard-boundary ops (``tp/shard_boundary.py``): a graph input or output kept on its shards.

``from_tp_shards(x, dim, group)`` means "the tensor the ranks' blocks ``x`` make up":
where ``x`` is a graph input that nothing else reads, its value is placed ``S(dim)``
with ``x`` itself as this rank's block, and the op becomes an alias (no all-gather).
``to_tp_shard(x, dim, group)`` means "this rank's block of ``x``": ``x`` is read as
``S(dim)`` (the planner converts a replicated or partial value) and the block is the
result, an alias again. Its result is rank-varying, which no placement names, so it may
only leave the graph: any other reader is refused by name, as is a group other than
the graph's, rather than run on values that mean something else on each rank.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...errors import ShardingError
from ...ir.op_table import add_spelling
from ...ir.ops import shape_of
from ..placement import R, S
from ..shard_boundary import BOUNDARY_OPS
from ..strategy import Call, Read, RuleContext, Strategy
from .registry import rule

for _kind, _spellings in BOUNDARY_OPS.items():
    add_spelling(_kind, *_spellings)

_ALIAS = torch.ops.aten.alias.default


def _operands(ctx: RuleContext, node: fx.Node) -> tuple[fx.Node, int]:
    """``x`` and its non-negative ``dim``; a group other than the graph's is refused."""
    x, dim, group = node.args[:3]
    if group != ctx.group:
        raise ShardingError(
            f"{node.name}: {node.target} names process group {group!r}, but this graph is "
            f"parallelized over {ctx.group!r}: pass the tp group the model was parallelized on"
        )
    assert isinstance(x, fx.Node) and isinstance(dim, int)
    ndim = len(shape_of(x) or ())
    return x, dim % ndim if ndim else dim


@rule("from_tp_shards", always=True)
def stage_input(ctx: RuleContext, node: fx.Node) -> Strategy:
    x, dim = _operands(ctx, node)
    if x.op != "placeholder" or ctx.is_param(x) or len(x.users) != 1:
        raise ShardingError(
            f"{node.name}: from_tp_shards keeps a graph input on its shards only where the "
            f"input ({x.name}) is a graph input read by nothing else; here it is "
            f"{'a parameter' if ctx.is_param(x) else x.op} read by {len(x.users)} node(s)"
        )
    return Strategy(
        out=S(dim), reads={x: Read(R, "this rank's block, as it arrived")},
        call=Call(_ALIAS, (x,)), copy_in=False, label="input kept on its shards",
    )  # fmt: skip


@rule("to_tp_shard", always=True)
def stage_output(ctx: RuleContext, node: fx.Node) -> Strategy:
    x, dim = _operands(ctx, node)
    readers = [u.name for u in node.users if u.op != "output"]
    if readers:
        raise ShardingError(
            f"{node.name}: to_tp_shard's result differs on every rank; it may only be "
            f"returned, but {', '.join(readers)} read(s) it"
        )
    return Strategy(
        out=R, reads={x: Read(S(dim), "returned as this rank's block")},
        call=Call(_ALIAS, (x,)), copy_in=False, label="output kept on its shards",
    )  # fmt: skip
