"""Bottleneck detection from graph structure (no names), on the model zoo."""

from __future__ import annotations

import torch
from torch import nn

from boost_compiler import detect
from examples.cola_llama import build, example_inputs
from tests import models

LLAMA_PROJ = {
    "attn.q_proj": "d->d",
    "attn.k_proj": "d->kv",
    "attn.v_proj": "d->kv",
    "attn.o_proj": "d->d",
    "mlp.gate_proj": "d->ff",
    "mlp.up_proj": "d->ff",
    "mlp.down_proj": "ff->d",
}


def _expected_llama(n_layers: int, d: int, kv: int, ff: int, r: int) -> set[tuple]:
    dims = {"d": d, "kv": kv, "ff": ff}
    out = set()
    for i in range(n_layers):
        for proj, io in LLAMA_PROJ.items():
            a, b = io.split("->")
            p = f"layers.{i}.{proj}"
            out.add((f"{p}.down.weight", f"{p}.up.weight", dims[a], r, dims[b], ("silu",)))
    return out


def _as_tuples(found) -> set[tuple]:
    return {(b.down, b.up, b.d_in, b.rank, b.d_out, b.ops) for b in found}


def test_nn_linear_cola_llama() -> None:
    model = build("tiny")
    cfg = model.cfg
    found = detect(model, example_inputs(cfg))
    assert len(found) == 7 * cfg.n_layers
    assert _as_tuples(found) == _expected_llama(cfg.n_layers, 64, 64, cfg.d_ff, cfg.rank)


def test_grouped_query_cola_llama() -> None:
    model, inputs = models.make_gqa_cola()
    cfg = model.cfg
    kv = cfg.num_kv_heads * cfg.head_dim
    assert _as_tuples(detect(model, inputs)) == _expected_llama(
        cfg.n_layers, cfg.d_model, kv, cfg.d_ff, cfg.rank
    )


def test_cola_reference_layout_raw_matmul_parameters() -> None:
    model, inputs = models.make_cola_ref_layout()
    found = detect(model, inputs)
    names = {n for n, _ in model.named_parameters() if n.endswith("cola_a")}
    assert {b.down for b in found} == names and len(found) == len(names)
    for b in found:
        assert b.up == b.down.replace("cola_a", "cola_b")
        a, bb = model.get_parameter(b.down), model.get_parameter(b.up)
        assert (b.d_in, b.rank, b.d_out) == (a.shape[0], a.shape[1], bb.shape[1])
        assert b.ops == ("silu",)


def test_svd_pair_no_activation_bias_on_up() -> None:
    model, inputs = models.make_svd_pair()
    [b] = detect(model, inputs)
    assert (b.down, b.up, b.up_bias, b.down_bias, b.ops) == (
        "seq.0.weight",
        "seq.1.weight",
        "seq.1.bias",
        None,
        (),
    )
    assert (b.d_in, b.rank, b.d_out) == (
        model.seq[0].in_features,
        model.seq[0].out_features,
        model.seq[1].out_features,
    )


def test_fused_qkv_up_factor_is_one_bottleneck() -> None:
    model, inputs = models.make_fused_qkv_up()
    [b] = detect(model, inputs)
    d = model.down.in_features
    assert (b.down, b.up, b.d_in, b.rank, b.d_out) == (
        "down.weight",
        "up.weight",
        d,
        model.down.out_features,
        3 * d,
    )


def test_gpt2_svd_with_fused_qkv_and_biases() -> None:
    model, inputs = models.make_gpt2_svd()
    found = detect(model, inputs)
    per_layer = {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}
    assert len(found) == len(per_layer) * len(model.h)
    assert all(b.ops == () and b.up_bias == b.up.replace("weight", "bias") for b in found)
    assert any(b.d_out == 3 * b.d_in for b in found)  # the fused q/k/v up factor


def test_no_bottleneck_in_dense_and_a_latent_one_with_a_norm_between() -> None:
    model, inputs = models.make_dense()
    assert detect(model, inputs) == []
    # A norm over r runs on the replicated latent under BTP: a latent chain (MLA's shape).
    model, inputs = models.make_norm_between()
    [b] = detect(model, inputs)
    assert (b.kind, b.down, b.up, b.rank, b.latent, b.ops) == (
        "latent", "down.weight", "up.weight", 16, 16, ("layer_norm",)
    )  # fmt: skip


def test_rank_not_smaller_than_both_ends_is_not_a_bottleneck() -> None:
    widening = nn.Sequential(nn.Linear(64, 16), nn.SiLU(), nn.Linear(16, 8))  # 16 > 8
    assert detect(widening, (torch.randn(2, 64),)) == []
    reduce_between = _ReduceBetween()
    assert detect(reduce_between, (torch.randn(2, 5, 64),)) == []


class _ReduceBetween(nn.Module):
    """A softmax (mixes the r positions) between the factors."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = nn.Linear(64, 16), nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.softmax(self.down(x), dim=-1))


def test_casts_dropout_and_matmul_with_bias() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(64, 16))
            self.bias = nn.Parameter(torch.zeros(16))
            self.b = nn.Parameter(torch.randn(16, 48))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.matmul(x, self.a) + self.bias
            h = nn.functional.dropout(nn.functional.gelu(h.float()), 0.1, self.training)
            return h @ self.b

    [b] = detect(Mixed(), (torch.randn(2, 64),))
    assert (b.down, b.up, b.d_in, b.rank, b.d_out) == ("a", "b", 64, 16, 48)
    assert b.ops == ("add", "float", "gelu", "dropout")


def test_40b_on_meta_device() -> None:
    """The dense 40B shape (d=8192, 48 layers), meta device, in a fresh process: every
    bottleneck found at rank 2048. Its time and memory bounds are a benchmark
    (``python benchmarks/detect_40b.py``), not a test."""
    from benchmarks.detect_40b import detect_40b

    result = detect_40b()
    print("40B meta detection:", result)
    assert result["n"] == 7 * 48 and result["ranks"] == [2048]
