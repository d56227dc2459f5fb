"""A rank's slice of a ``torch._grouped_mm`` expert weight keeps the kernel's 16-byte
stride alignment: the experts go on ranks whole instead, or the plan is refused (issue 42,
item 6f; issue 44, item 9).

On CUDA the kernel rejects a misaligned operand only when the step runs; the planner
refuses the split first, before any parameter is touched. bf16 experts of widths 24 at
tp=2 leave each rank 12 elements (24 bytes) whichever width is split; widths 32 leave
16 (32 bytes). Expert parallelism splits no width: with 4 experts each rank holds 2 whole
ones; with 3 it cannot, and the plan is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import boost_compiler
from boost_compiler.errors import ExpertAlignmentError
from boost_compiler.tp.collectives import fake_process_group
from boost_compiler.tp.placement import S

E, TOKENS = 4, 16


class Experts(nn.Module):
    """Routed experts as transformers runs them in bf16: two grouped GEMMs, ReLU between."""

    def __init__(self, hidden: int, inter: int, experts: int = E) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Parameter(torch.randn(experts, hidden, inter, generator=gen).bfloat16())
        self.down = nn.Parameter(torch.randn(experts, inter, hidden, generator=gen).bfloat16())

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch._grouped_mm(x, self.up, offs=offs))
        return torch._grouped_mm(h, self.down, offs=offs)


def _inputs(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(TOKENS, hidden).bfloat16(), torch.tensor([4, 8, 12, 16]).int()


def test_a_misaligned_expert_slice_is_refused_at_plan_time() -> None:
    with fake_process_group(2):
        model = Experts(24, 24, experts=3)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        offs = torch.tensor([5, 10, 16]).int()
        with pytest.raises(ExpertAlignmentError, match=r"tp=2 gives each rank 12 .*multiple of 8"):
            boost_compiler.parallelize(model, dist.group.WORLD, (_inputs(24)[0], offs))
        for name, value in model.state_dict().items():  # nothing was sharded
            assert value.shape == before[name].shape and torch.equal(value, before[name]), name


def test_misaligned_experts_go_on_ranks_whole() -> None:
    with fake_process_group(2):
        model = Experts(24, 24)
        boost_compiler.parallelize(model, dist.group.WORLD, _inputs(24))
        plan = model.boost_plan
        assert plan.fallbacks == [] and plan.params == {"up": S(0), "down": S(0)}
        assert [tuple(p.shape) for p in model.parameters()] == [(2, 24, 24)] * 2
        assert any("expert-parallel, 2 of 4 per rank (their intermediate split breaks the "
                   "kernel's alignment)" in d for d in plan.decisions), plan.decisions  # fmt: skip


def test_an_aligned_expert_slice_is_split() -> None:
    with fake_process_group(2):
        model = Experts(32, 32)
        boost_compiler.parallelize(model, dist.group.WORLD, _inputs(32))
        assert model.boost_plan.fallbacks == []
        assert {tuple(p.shape) for p in model.parameters()} != {(E, 32, 32)}  # split
