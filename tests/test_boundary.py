"""Shard boundaries (``tp/shard_boundary.py``): a graph input and output kept on the tp shards.

On torch's fake process group (one process, p=2): ``parallelize`` of a module whose
forward takes its hidden state as ``from_tp_shards(x)`` and returns ``to_tp_shard(h)``
plans both as aliases (no collective at either end, the low-rank bottleneck inside
still sharded), and refuses by name, before any parameter changes, the uses where an
alias would not be exact. The real two-rank numbers are the pipeline's
(``tests/test_pipeline.py``: stages exact, no boundary all-gather in gloo's events).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from boost_compiler.errors import ShardingError
from boost_compiler.tp.collectives import fake_process_group
from boost_compiler.tp.shard_boundary import from_tp_shards, to_tp_shard


class _Stage(nn.Module):
    """A residual low-rank block between two shard boundaries (``misuse`` breaks them)."""

    def __init__(self, group: str, misuse: str = "") -> None:
        super().__init__()
        self.group, self.misuse = group, misuse
        self.down, self.up = nn.Linear(16, 4, bias=False), nn.Linear(4, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.misuse == "input read twice":
            h = from_tp_shards(x, 2, self.group) + x.sum()
        elif self.misuse == "not an input":
            h = from_tp_shards(x * 2, 2, self.group)
        else:
            h = from_tp_shards(x, 2, self.group)
        h = h + self.up(torch.relu(self.down(h)))
        out = to_tp_shard(h, 2, self.group)
        return out * 2 if self.misuse == "output read" else out


def _parallelize(misuse: str = "") -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    import boost_compiler

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2,))
    model = _Stage(dist.group.WORLD.group_name, misuse)
    boost_compiler.parallelize(model, mesh, (torch.randn(2, 3, 8, requires_grad=True),))
    return model


def test_boundaries_are_aliases_and_the_bottleneck_is_still_split() -> None:
    with fake_process_group(2):
        model = _parallelize()
        plan = model.boost_plan
        assert plan.fallbacks == []
        assert plan.params["down.weight"].is_shard and plan.params["up.weight"].is_shard
        # the r-wide bottleneck's all-reduce forward (g) and backward (f) only: nothing
        # gathers the hidden state at either boundary, in either direction
        got = [(c.kind, c.global_shape, c.forward, c.backward) for c in plan.collectives]
        assert got == [("all_reduce", (2, 3, 4), True, False),
                       ("all_reduce", (2, 3, 4), False, True)], got  # fmt: skip


@pytest.mark.parametrize("misuse", ["input read twice", "not an input", "output read"])
def test_misused_boundaries_are_refused_before_anything_changes(misuse: str) -> None:
    with fake_process_group(2):
        with pytest.raises(ShardingError, match="from_tp_shards|to_tp_shard"):
            _parallelize(misuse)


def test_boundary_ops_compute_the_gather_and_the_slice_outside_a_plan() -> None:
    """Eagerly (no parallelized graph) the ops are what they mean: on one rank of one,
    the gather and the slice are the tensor itself, and gradients pass through."""
    with fake_process_group(1) as group:
        x = torch.randn(2, 3, 8, requires_grad=True)
        y = to_tp_shard(from_tp_shards(x, 2, group) * 3, 2, group)
        assert torch.equal(y, x * 3)
        y.sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 3.0))
