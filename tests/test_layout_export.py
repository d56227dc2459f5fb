"""Layouts written from a model that did not come from them, and the folders real runs hold.

``tests/test_layouts.py`` round-trips folders read in the same layout, so the layout's own
config is written back as it was read: the config an exporter *builds* is never used
there. Here a tiny transformers Llama made low-rank by ``boost_compiler.to_low_rank`` (the
model of ``boost train --hf-config``) is saved in each layout, and the folder's logits are
compared with the source model's through (a) the layout's own forward written from its
published math (``tests/layout_refs.py``, independent of ``boost_compiler.layouts``) and
(b) ``boost_compiler.from_pretrained`` of the folder. The sources cover what the
exporters decide: CoLA's ``only_lr_act`` (from ``hidden_act``) and biases, different
attention and MLP ranks, LORO's attention-only / MLP-only scope, SLTrain's sparse part.

Then the fixtures real folders hold and the defaults of ``layout_refs`` do not: CoLA's
``only_lr_act`` absent (ColaConfig's default, true) and biases, LORO's scopes and two
ranks, SLTrain's trained ``scaling``, Nanotron's ``qkv_proj1`` and a ``qkv_proj0``
sharded along its input dimension: each imports equal to its layout's forward and
exports back to the same tensors. One process, CPU, about a second per case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.extras import need

need("transformers")
need("safetensors")

import boost_compiler  # noqa: E402
from boost_compiler import layouts  # noqa: E402
from boost_compiler.errors import LayoutError  # noqa: E402
from boost_compiler.sparse import SparsePart  # noqa: E402
from tests.layout_refs import read_folder, reference_logits, write_folder  # noqa: E402
from tests.tp_harness import RTOL, _rel  # noqa: E402

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def _llama(kv: int = 4, **config: Any) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv, vocab_size=VOCAB,
                         **config)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn at a scale where each term of the forward shows in the
    logits (transformers' 0.02 init makes the blocks small beside the embedding, so a
    wrong MLP activation or a dropped bias would move them little)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
        for m in model.modules():
            if isinstance(m, SparsePart):  # SLTrain's S: 3% of the entries, fixed support
                m.mask.copy_(torch.rand(m.mask.shape, generator=g) < 0.03)
                m.weight.mul_(m.mask)
    return model


def _low_rank(model: torch.nn.Module, method: str, attn: int, mlp: int,
              scope: str = "all") -> torch.nn.Module:  # fmt: skip
    """``to_low_rank`` of the attention and / or MLP projections, each at its own rank."""
    if scope in ("all", "attn"):
        boost_compiler.to_low_rank(model, method=method, rank=attn, include="*.self_attn")
    if scope in ("all", "mlp"):
        boost_compiler.to_low_rank(model, method=method, rank=mlp, include="*.mlp")
    return model


def _with_sparse(model: torch.nn.Module) -> torch.nn.Module:
    """SLTrain's shape of a projection: the pair plus a fixed-support sparse ``S``."""
    for m in model.modules():
        if isinstance(m, boost_compiler.LowRankLinear):
            m.sparse = SparsePart(m.in_features, m.out_features)
    return model


def _source(method: str = "cola", attn: int = 16, mlp: int = 16, scope: str = "all",
            sparse: bool = False, **config: Any) -> torch.nn.Module:  # fmt: skip
    model = _low_rank(_llama(**config), method, attn, mlp, scope)
    return _with_sparse(model) if sparse else model


LINEAR = {"hidden_act": "linear"}  # CoLA's only_lr_act: no activation on the MLP's gate
BIAS = {"attention_bias": True, "mlp_bias": True}
# name -> (layout, _source's arguments). Ranks 8 / 16: attention and MLP differ wherever
# the layout has a rank per half (LORO, Nanotron); CoLA and SLTrain have one rank.
SOURCES: dict[str, tuple[str, dict[str, Any]]] = {
    "cola": ("cola", {}),
    "cola-only_lr_act": ("cola", LINEAR),
    "cola-bias": ("cola", BIAS),
    "cola-m": ("cola-m", {}),
    "cola-m-only_lr_act": ("cola-m", LINEAR),
    "cola-m-bias": ("cola-m", BIAS),
    "loro": ("loro", {"method": "svd", "attn": 8, "kv": 2}),
    "loro-attn": ("loro", {"method": "svd", "attn": 8, "scope": "attn", "kv": 2}),
    "loro-mlp": ("loro", {"method": "svd", "attn": 8, "scope": "mlp", "kv": 2}),
    "sltrain": ("sltrain", {"method": "svd", "sparse": True, "kv": 2}),
    "boost-nanotron": ("boost-nanotron", {"attn": 8, "kv": 2}),
    "boost-nanotron-only_lr_act": ("boost-nanotron", {"attn": 8, "kv": 2, **LINEAR}),
}


@pytest.mark.parametrize("case", SOURCES)
def test_a_model_from_elsewhere_exports_to_its_logits(case: str, tmp_path: Path) -> None:
    """The exported folder, read by the layout's own forward and by boost, gives the
    source model's logits: the config the exporter built says what the model computes."""
    layout, args = SOURCES[case]
    source = _randomize(_source(**args), seed=len(case))
    want = _logits(source)
    out = layouts.save(source, tmp_path / case, layout)
    assert layouts.detect(out) == layout
    ref = _rel(reference_logits(layout, out, IDS), want)
    back = _rel(_logits(boost_compiler.from_pretrained(out)), want)
    print(f"{case}: the layout's forward {ref:.2e}, from_pretrained {back:.2e}")
    assert ref <= RTOL
    assert back <= RTOL


# name -> (layout, write_folder's options): what real folders hold beyond the defaults.
FIXTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "cola-only_lr_act-absent": ("cola", {"only_lr_act": None}),
    "cola-only_lr_act-true": ("cola", {"only_lr_act": True}),
    "cola-bias": ("cola", {"bias": True}),
    "cola-m-only_lr_act-absent": ("cola-m", {"only_lr_act": None}),
    "cola-m-bias": ("cola-m", {"bias": True}),
    "loro-attn-only": ("loro", {"scope": "attn", "attn_rank": 8}),
    "loro-mlp-only": ("loro", {"scope": "mlp", "mlp_rank": 8}),
    "loro-two-ranks": ("loro", {"attn_rank": 8, "mlp_rank": 24}),
    "sltrain-trainable_scaling": ("sltrain", {"trainable_scaling": True}),
    "nanotron-qkv_proj1": ("boost-nanotron", {"qkv_up": True}),
    "nanotron-qkv_proj0-row-parallel": ("boost-nanotron", {"row_parallel_qkv0": True}),
    "nanotron-two-ranks": ("boost-nanotron", {"attn_rank": 8, "mlp_rank": 24}),
}


@pytest.mark.parametrize("case", FIXTURES)
def test_what_real_folders_hold_imports_and_exports_back(case: str, tmp_path: Path) -> None:
    layout, options = FIXTURES[case]
    folder = tmp_path / "in"
    write_folder(layout, folder, seed=7, **options)
    assert layouts.detect(folder) == layout
    model = boost_compiler.from_pretrained(folder)
    want = reference_logits(layout, folder, IDS)
    err = _rel(_logits(model), want)
    print(f"{case}: import vs the layout's forward {err:.2e}")
    assert err <= RTOL
    out = layouts.save(model, tmp_path / "out", layout)
    (src_cfg, src), (out_cfg, back) = read_folder(folder), read_folder(out)
    assert out_cfg == src_cfg
    assert {k: (v.shape, v.dtype) for k, v in back.items()} == {
        k: (v.shape, v.dtype) for k, v in src.items()
    }
    for key, t in src.items():  # SLTrain's lora_A = down / tanh(scaling): within an ulp
        if layout == "sltrain" and key.endswith("lora_A"):
            torch.testing.assert_close(back[key], t, rtol=1e-6, atol=0, msg=key)
        else:
            assert torch.equal(back[key], t), key
    assert _rel(reference_logits(layout, out, IDS), want) <= RTOL


def test_cola_cannot_hold_two_ranks(tmp_path: Path) -> None:
    """CoLA's config has one ``rank`` for every ColaLayer: attention and MLP at different
    ranks is refused by name, not written as a folder CoLA's code cannot load."""
    source = _source(attn=8)
    with pytest.raises(LayoutError, match="one `rank`"):
        layouts.save(source, tmp_path / "c", "cola")


@pytest.mark.parametrize("layout", ["loro", "sltrain"])
def test_a_rope_the_layout_cannot_compute_is_refused(layout: str, tmp_path: Path) -> None:
    """LORO's and SLTrain's Llama (peft_pretraining/modeling_llama.py) rotate with base
    10000 whatever the config says: a model with rope_theta 500000 written there would be
    another model (0.09 off in logits), so the export names the difference instead."""
    source = _source("svd", sparse=layout == "sltrain", kv=2, rope_theta=500000.0)
    with pytest.raises(LayoutError, match=r"rope_theta 500000.*base 10000"):
        layouts.save(source, tmp_path / "r", layout)
