"""Cost model: BOOST's published table, agreement with captured plans, GEMM intensity, CLI."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from fractions import Fraction

import pytest
import sympy as sp
import torch
import torch.distributed as dist

import boost_compiler
from boost_compiler import costmodel as cm
from boost_compiler.cli import main
from boost_compiler.tp.collectives import fake_process_group
from examples.cola_llama import build, example_inputs

from .conftest import ROOT

# BOOST, per-layer forward communication at b=4, s=4096, bf16 (MiB): dense, standard, BTP.
PAPER = {"3b": (192, 992, 168), "7b": (256, 1328, 224), "13b": (320, 1664, 280)}


@pytest.mark.parametrize("name", PAPER)
@pytest.mark.parametrize("tp", [2, 4])
def test_paper_forward_table_exactly(name: str, tp: int) -> None:
    rep = cm.cost(name, tp, batch=4, seq=4096, dtype="bf16")
    dense, standard, btp = PAPER[name]
    fwd = {n: c.forward for n, c in rep.strategies.items()}
    assert fwd["dense"].payload_bytes == dense * 2**20
    assert fwd["standard"].payload_bytes == standard * 2**20
    assert fwd["btp"].payload_bytes == btp * 2**20
    # BOOST: grouping changes counts, not bytes; but the online-norm all-reduces carry
    # their 5r latents in fp32 (statistics accuracy), the o/down ones in bf16: 24r vs 14r.
    assert fwd["boost"].payload_bytes * 14 == btp * 2**20 * 24
    assert (fwd["dense"].mib, fwd["standard"].mib, fwd["btp"].mib) == (dense, standard, btp)
    # The exact norm's statistics come on top: two [b, s, 1] fp32 all-reduces.
    assert fwd["btp"].stats_bytes == 2 * 4 * 4096 * 4
    assert (fwd["dense"].collectives, fwd["standard"].collectives) == (2, 7)
    assert (fwd["btp"].collectives, fwd["boost"].collectives) == (9, 4)


def test_symbolic_formulas() -> None:
    f = cm.formulas()
    mha = {cm.H_kv: cm.H}
    assert sp.simplify(f["standard"].forward.act.subs(mha) - (5 * cm.d + 2 * cm.d_ff)) == 0
    assert f["btp"].forward.act == f["btp"].backward.act == 7 * cm.r
    assert f["boost"].backward.stats == 0  # online norm: identity backward
    assert f["dense"].forward.bytes == 2 * cm.d * cm.b * cm.s * cm.e
    # DTensor's per-module plans: one backward all-reduce per column-parallel module.
    un = cm.formulas(fused=False)
    assert un["dense"].backward.act == 5 * cm.d and un["dense"].backward.count == 5
    assert un["standard"].backward.act == 6 * cm.d + cm.d_ff


def test_matches_bytes_measured_in_readme() -> None:
    """README: gloo profiler bytes/token/layer (fwd+bwd), tp=2, d=256, d_ff=688, r=64, fp32."""
    dims = cm.LlamaDims("bench", d=256, d_ff=688, n_layers=2, n_heads=4, rank=64)
    rep = cm.cost(dims, 2, batch=1, seq=1, dtype="fp32", fused=False)  # DTensor: per module
    per_token = {
        n: c.forward.total_bytes + c.backward.total_bytes for n, c in rep.strategies.items()
    }
    assert (per_token["btp"], per_token["standard"], per_token["dense"]) == (3600, 19520, 7168)


@functools.cache
def _plan_comm(
    world: int, dtype: torch.dtype = torch.float32, n_layers: int = 2, kv: int = 4,
    labels: bool = False,
):  # fmt: skip
    """parallelize the tiny CoLA-LLaMA (d=64, r=16, d_ff=172, 4 heads) on the fake group."""
    overrides = {"n_layers": n_layers, "n_kv_heads": kv}
    with fake_process_group(world):
        model = build("tiny", **overrides).to(dtype)
        ids = example_inputs(model.cfg, seq=16)
        kwargs = {"labels": ids[0]} if labels else None
        boost_compiler.parallelize(model, dist.group.WORLD, ids, kwargs)
        plan = model.boost_plan
    assert plan.fallbacks == []
    return cm.LlamaDims.from_model_config(model.cfg), cm.plan_comm(plan)


@pytest.mark.parametrize(
    ("world", "dtype", "n_layers", "kv", "labels"),
    [(2, torch.float32, 2, 4, False), (4, torch.float32, 2, 4, False),
     (2, torch.bfloat16, 3, 2, False), (2, torch.float32, 2, 4, True),
     (2, torch.bfloat16, 3, 2, True)],
)  # fmt: skip
def test_formula_matches_captured_plan(
    world: int, dtype: torch.dtype, n_layers: int, kv: int, labels: bool
) -> None:
    """Whole step: L x the boost formula + final norm statistics + LM-head all-gather.

    parallelize's plan runs the default passes (group_linears, online_norm), so the
    plan is BOOST's; in bf16 that includes the fp32 online-norm payloads. With
    ``labels`` the loss is in the graph: the head is vocabulary-parallel, so its
    input's gradient is all-reduced and the loss adds its per-token statistics.
    """
    dims, got = _plan_comm(world, dtype, n_layers, kv, labels)
    want = cm.step_bytes(
        dims, world, 2, 16, {torch.float32: "fp32"}.get(dtype, "bf16"), loss=labels
    )
    assert got.forward_bytes == want["forward_bytes"]
    assert got.backward_bytes == want["backward_bytes"]
    assert got.forward_collectives == want["forward_collectives"]
    assert got.backward_collectives == want["backward_collectives"]


def test_per_layer_increment_of_plan_is_the_boost_formula() -> None:
    """Two depths: embedding, final norm and LM-head gather cancel in the difference."""
    dims2, two = _plan_comm(2, n_layers=2)
    _, four = _plan_comm(2, n_layers=4)
    layer = cm.cost(dims2, 2, batch=2, seq=16, dtype="fp32").strategies["boost"]
    assert (four.forward_bytes - two.forward_bytes) / 2 == layer.forward.total_bytes
    assert (four.backward_bytes - two.backward_bytes) / 2 == layer.backward.total_bytes
    assert (four.forward_collectives - two.forward_collectives) / 2 == layer.forward.collectives
    # tiny: r = 16, fp32, b*s = 32 tokens: 7r of latents + 2 norm statistics, 4 collectives.
    assert layer.forward.total_bytes == 32 * (7 * 16 * 4 + 2 * 4) == 14592


def test_arithmetic_intensity_by_hand() -> None:
    # 7B standard TP at p=4, up factor of q: [16384, 256] @ [256, 4096] in bf16.
    flops = 2 * 16384 * 256 * 4096  # = 2**35
    nbytes = 2 * (16384 * 256 + 256 * 4096 + 16384 * 4096)  # = 144_703_488 = 138 * 2**20
    assert (flops, nbytes) == (34_359_738_368, 144_703_488)
    assert cm.arithmetic_intensity(16384, 256, 4096, 2) == sp.Rational(32768, 138)
    rep = cm.cost("7b", 4, batch=4, seq=4096, dtype="bf16")
    std = {g.name: g for g in rep.strategies["standard"].gemms}["q.A"]
    assert (std.M, std.K, std.N, std.flops, std.bytes) == (16384, 256, 4096, flops, nbytes)
    assert Fraction(std.flops, std.bytes) == Fraction(32768, 138)  # 237.4 FLOP/B
    btp = {g.name: g for g in rep.strategies["btp"].gemms}["q.A"]
    assert (btp.K, btp.N) == (1024, 1024)  # K = r: [16384,1024] @ [1024,1024]
    assert Fraction(btp.flops, btp.bytes) == Fraction(2**35, 2 * (2 * 2**24 + 2**20))
    assert rep.strategies["standard"].intensity < 0.5 * rep.strategies["btp"].intensity


def test_alpha_beta_estimate_by_hand() -> None:
    link = cm.Link(bandwidth_gbps=100.0, latency_us=1.0)
    rep = cm.cost("7b", 4, batch=4, seq=4096, dtype="bf16", link=link)
    fwd = rep.strategies["btp"].forward  # 9 all-reduces, 2(p-1) = 6 steps each
    want = 9 * 6 * 1e-6 + 2 * 3 / 4 * fwd.total_bytes / 100e9
    assert fwd.time_s == pytest.approx(want, rel=1e-12)


def test_not_divisible_names_the_dimension() -> None:
    with pytest.raises(boost_compiler.errors.ShardingError, match=r"hidden size d = 4096.*tp=3"):
        cm.cost("7b", 3, batch=4, seq=4096)
    with pytest.raises(boost_compiler.errors.ShardingError, match=r"attention heads H = 24.*tp=16"):
        cm.cost("3b", 16, batch=4, seq=4096)


def test_cli_json_subprocess() -> None:
    args = ["cost", "--config", "7b", "--tp", "4", "--batch", "4", "--seq", "4096", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "boost_compiler.cli", *args, "--dtype", "bf16"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    data = json.loads(out.stdout)
    fwd = data["per_layer"]["forward"]
    # BOOST in bf16: 5r latents in fp32 with the statistics, 2r in bf16 = 24r bytes/token
    assert [fwd[f"{n}_mib"] for n in ("dense", "standard", "btp", "boost")] == [256, 1328, 224, 384]
    assert fwd["btp_total_mib"] == 224.125 and fwd["btp_collectives"] == 9
    assert fwd["boost_collectives"] == 4
    assert data["per_layer"]["backward"]["standard_mib"] == 728  # 3d + d_ff
    assert data["per_layer"]["backward"]["boost_mib"] == 224  # 7r in bf16, no statistics
    assert data["ratios_forward"]["standard/boost"] == pytest.approx(1328 / 384)


def test_cli_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--config", "13b", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "1,664.00" in out and "280.00" in out and "ESTIMATE" in out
    assert main(["cost", "--config", "8b"]) == 2
    err = capsys.readouterr().err
    assert "unknown config '8b'" in err and "1b, 3b, 7b, 13b, 30b, 40b" in err
    assert main(["cost", "--config", "7b", "--tp", "3"]) == 2
    assert "hidden size d = 4096 is not divisible" in capsys.readouterr().err
