"""``to_low_rank(..., experts=True)``: routed MoE experts factored per expert (issue 30).

Single process: at full rank the truncated SVD of every expert reproduces the dense
experts' logits (fp32); below it the conversion reports each projection's per-expert
rank and Frobenius error, and the rank rule refuses a rank that is no bottleneck. The
tp=2 training step of factored experts is in tests/test_moe.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import boost_compiler
from boost_compiler.convert_experts import LowRankExperts, is_routed_experts
from boost_compiler.errors import RankError
from tests.zoo_checks import MOE, VOCAB, build

# fp32: the factors' product differs from each expert's matrix by the SVD's rounding
# (measured relative Frobenius error about 1e-6 per projection), the logits by 2.6e-7 to
# 3.8e-7 of their largest magnitude over the three families. The tiny models' logits
# move little with the experts (a 1% change of one factor: 6e-5), so the experts'
# outputs are compared directly too.
FP32_TOL = 1e-5


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _routed(experts: torch.nn.Module, e: int, h: int) -> torch.Tensor:
    """``experts``' output for 32 random tokens, each routed to 2 random distinct experts."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, h, generator=g)
    picked = torch.rand(32, e, generator=g).topk(2, dim=-1).indices
    with torch.no_grad():
        return experts(x, picked, torch.rand(32, 2, generator=g))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", MOE)
def test_full_rank_reproduces_dense_experts(family: str) -> None:
    """Every expert at full rank (``min(d_in, d_out)`` of each of its matrices): the experts'
    outputs and the model's logits are the dense model's within fp32 rounding."""
    model = build(family)
    ref = copy.deepcopy(model)
    worst = 0.0
    for name, mod in list(model.named_modules()):
        if is_routed_experts(mod):
            e, two_i, h = mod.gate_up_proj.shape
            new = LowRankExperts.from_dense(mod, (min(two_i, h), min(h, two_i // 2)), "svd")
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)
            worst = max(worst, _err(_routed(new, e, h), _routed(mod, e, h)))
            # A factor off by 1% is seen: the comparison can fail.
            with torch.no_grad():
                new.down_proj_up.mul_(1.01)
            assert _err(_routed(new, e, h), _routed(mod, e, h)) > 100 * FP32_TOL
            with torch.no_grad():
                new.down_proj_up.div_(1.01)
    assert sum(isinstance(m, LowRankExperts) for m in model.modules()) > 0
    assert worst <= FP32_TOL, worst
    logits = _err(_logits(model), _logits(ref))
    assert logits <= FP32_TOL, logits


def test_to_low_rank_experts_opt_in() -> None:
    dense = build("qwen3_moe")
    assert not any(isinstance(m, LowRankExperts) for m in dense.modules())  # off by default
    model = build("qwen3_moe")
    report = boost_compiler.to_low_rank(model, method="svd", rank=16, include="*.experts",
                                        experts=True)  # fmt: skip
    rows = {layer.name: layer for layer in report.layers}
    assert sorted(rows) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                            for p in ("down_proj", "gate_up_proj")]  # fmt: skip
    row = rows["model.layers.0.mlp.experts.gate_up_proj"]
    assert (row.d_in, row.rank, row.d_out) == (64, 16, 64)
    assert row.params_after == 4 * 16 * (64 + 64) and 0 < row.rel_error < 1
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LowRankExperts) and experts.activation is None
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters()}
    assert shapes == {"gate_up_proj_down": (4, 16, 64), "gate_up_proj_up": (4, 64, 16),
                      "down_proj_down": (4, 16, 32), "down_proj_up": (4, 64, 16)}  # fmt: skip
    with pytest.raises(RankError, match="down_proj"):
        boost_compiler.to_low_rank(build("qwen3_moe"), rank=32, include="*.experts", experts=True)


def test_factored_experts_survive_save_and_from_pretrained(tmp_path: Any) -> None:
    """record_layout writes the factored experts into config.json; from_pretrained rebuilds
    them (not dense) and loads their factors: the same logits. A record naming a module
    that is not routed experts is refused by name before anything is replaced."""
    import json

    from boost_compiler.errors import HFFolderError
    from boost_compiler.hf_io import LOW_RANK_KEY, record_layout

    model = build("qwen3_moe").eval()
    boost_compiler.to_low_rank(model, method="svd", rank=16, include="*.experts", experts=True)
    record = record_layout(model)
    assert sorted(record["experts"]) == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    model.save_pretrained(tmp_path / "m")
    back = boost_compiler.from_pretrained(tmp_path / "m").eval()
    experts = back.model.layers[1].mlp.experts
    assert isinstance(experts, LowRankExperts) and experts.ranks == (16, 16)
    assert _err(_logits(back), _logits(model)) <= FP32_TOL
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    spec = cfg[LOW_RANK_KEY]["experts"].pop("model.layers.1.mlp.experts")
    cfg[LOW_RANK_KEY]["experts"]["model.layers.1.mlp.gate"] = spec
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFFolderError, match="model.layers.1.mlp.gate"):
        boost_compiler.from_pretrained(tmp_path / "m")
