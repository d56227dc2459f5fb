"""The norms' statistics are fp32 whatever the activations' dtype (``tp/sharded_ops.py``).

``sharded_rms_norm``, ``sharded_layer_norm`` and ``online_rms_norm_reduce`` promise the
statistic torch computes for a bf16 input: a sum of squares in fp32, one rounding to bf16
at the end. A test in fp32 cannot see it. Here each runs in one process on a group of one (the
fake process group: its all-reduce returns its input, which for one rank is the sum), so
the shard is the whole row and the output must be the fp32-statistics result rounded
once: a bf16 statistic (``rsqrt`` of a bf16 sum of squares at d=4096, a relative step of
2^-8) rounds about a quarter of the outputs differently. A handful of ties may round
apart even in fp32 (another summation order), hence the 1% allowance.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from boost_compiler.tp import sharded_ops
from boost_compiler.tp.groups import fake_process_group

D, TOKENS, EPS = 4096, 64, 1e-6
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def group() -> Iterator[str]:
    with fake_process_group(1) as name:
        yield name


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # rows of different scales, so the statistic's rounding differs from token to token
    x = torch.randn(TOKENS, D, generator=g) * (1 + 3 * torch.rand(TOKENS, 1, generator=g))
    w = 1 + 0.1 * torch.randn(D, generator=g)
    return x.to(BF16), w.to(BF16)


def _differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """The fraction of outputs that are not the reference's bf16 value."""
    assert got.dtype == want.dtype == BF16
    return (got != want).float().mean().item()


def test_sharded_rms_norm_statistic_is_fp32(group: str) -> None:
    x, w = _inputs()
    got = sharded_ops.sharded_rms_norm(x, w, EPS, D, group)
    want = F.rms_norm(x.float(), (D,), None, EPS).to(BF16) * w  # the module's order
    frac = _differ(got, want)
    print(f"rms_norm: {frac:.2%} of the outputs differ from the fp32 statistic's")
    assert frac < 0.01


def test_sharded_layer_norm_statistics_are_fp32(group: str) -> None:
    x, w = _inputs()
    x = x + 3  # a mean to subtract: the variance's rounding matters too
    got = sharded_ops.sharded_layer_norm(x, w, None, EPS, D, group)
    want = F.layer_norm(x.float(), (D,), None, None, EPS).to(BF16) * w
    frac = _differ(got, want)
    print(f"layer_norm: {frac:.2%} of the outputs differ from the fp32 statistics'")
    assert frac < 0.01


def test_online_rms_norm_scale_is_fp32(group: str) -> None:
    """The norm deferred into the down factors' all-reduce: each partial ``(x * w) @ A``
    scaled by ``rsqrt(mean(x^2) + eps)`` computed in fp32, rounded once to bf16."""
    x, w = _inputs()
    a = (torch.randn(D, 32, generator=torch.Generator().manual_seed(1)) * D**-0.5).to(BF16)
    partial = (x * w) @ a
    [got] = sharded_ops.online_rms_norm_reduce([partial], x, EPS, D, group)
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    want = (partial.float() * scale).to(BF16)
    frac = _differ(got, want)
    print(f"online rms_norm: {frac:.2%} of the outputs differ from the fp32 scale's")
    assert frac < 0.01
