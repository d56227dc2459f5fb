"""The sharding-rule registry: a rule added from outside the package, and the op table's coverage.

A toy op (a ``torch.library`` custom op, so dynamo keeps it as one node) sits on
the hidden shard between two low-rank bottlenecks. Without a rule the shard is
gathered in front of it (a fallback in the plan); registering an op-table
spelling and a rule, here in this file only, keeps the shard through it. Every
registration happens inside ``registry.scope()``, so no test leaves a rule or
a spelling behind.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import boost_compiler
from boost_compiler.ir import op_table
from boost_compiler.tp.collectives import fake_process_group
from boost_compiler.tp.placement import Placement, S
from boost_compiler.tp.rules import registry
from boost_compiler.tp.rules.registry import rule
from boost_compiler.tp.strategy import RuleContext, Strategy


@torch.library.custom_op("boost_test::scaled_silu", mutates_args=())
def scaled_silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * 2.0


@scaled_silu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


TOY_KIND = "boost_test.scaled_silu"


class Toy(nn.Module):
    """``scaled_silu`` on the replicated input, then on the hidden shard between bottlenecks."""

    def __init__(self, d: int = 16, r: int = 4) -> None:
        super().__init__()
        self.down1, self.up1 = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)
        self.down2, self.up2 = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up1(F.silu(self.down1(scaled_silu(x))))  # h: hidden shard S(2)
        return self.up2(F.silu(self.down2(scaled_silu(h))))


def _plan():
    with fake_process_group(2):
        torch.manual_seed(0)
        model = Toy()
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randn(2, 8, 16),))
        return model.boost_plan


@pytest.fixture
def scoped() -> Iterator[None]:
    with registry.scope():
        yield
    assert torch.ops.boost_test.scaled_silu.default not in op_table.all_spellings()
    assert TOY_KIND not in registry.registered_kinds()


def test_a_rule_registered_outside_the_package_keeps_the_shard(scoped: None) -> None:
    op_table.add_spelling(TOY_KIND, torch.ops.boost_test.scaled_silu.default)
    without = _plan()
    # Only the sharded call falls back: the replicated one takes the shared default.
    assert len(without.fallbacks) == 1 and "scaled_silu" in without.fallbacks[0]

    seen: list[Placement] = []

    @rule(TOY_KIND)
    def same_placement(ctx: RuleContext, node: fx.Node) -> Strategy:
        """Element-wise: each rank computes its shard of the output from its shard."""
        pl = ctx.placement(node.args[0])
        seen.append(pl)
        return Strategy(out=pl)

    with_rule = _plan()
    assert with_rule.fallbacks == []
    assert seen == [S(2)]  # called once, on the shard; never on the replicated input
    assert with_rule.params == without.params
    gathers = [c for c in with_rule.collectives if c.kind == "all_gather" and c.forward]
    assert len(gathers) < len(
        [c for c in without.collectives if c.kind == "all_gather" and c.forward]
    )


def test_a_spelling_means_one_kind(scoped: None) -> None:
    op_table.add_spelling(TOY_KIND, torch.ops.boost_test.scaled_silu.default)
    op_table.add_spelling(TOY_KIND, torch.ops.boost_test.scaled_silu.default)  # idempotent
    with pytest.raises(ValueError, match="already spells"):
        op_table.add_spelling("mul", torch.ops.boost_test.scaled_silu.default)
    with pytest.raises(ValueError, match="already spells"):
        op_table.add_spelling("add", "__mul__")


def test_every_spelling_has_a_rule_or_is_listed_unsupported() -> None:
    kinds = set(op_table.all_spellings().values())
    ruled = registry.registered_kinds()
    missing = kinds - ruled - set(registry.UNSUPPORTED)
    assert not missing, f"op kinds with neither a sharding rule nor an UNSUPPORTED entry: {missing}"
    assert not set(registry.UNSUPPORTED) & ruled  # a listed kind that gained a rule: unlist it
    assert set(registry.UNSUPPORTED) <= kinds  # and every listed kind is one the table knows
    assert ruled <= kinds  # a rule for a kind no spelling reaches would never run
