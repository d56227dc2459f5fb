"""Smoke tests for the example CoLA-LLaMA and the test-only model variants."""

from __future__ import annotations

import pytest
import torch

from examples.cola_llama import (
    CONFIGS,
    ColaLlama,
    ColaLlamaConfig,
    LowRankLinear,
    build,
    config,
    example_inputs,
)
from tests.models import HAS_BOTTLENECK, MAKERS, gqa_cola


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_forward_finite(name: str) -> None:
    model, inputs = MAKERS[name]()
    with torch.no_grad():
        out = model(*inputs)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.float32
    assert out.shape[:2] == inputs[0].shape[:2]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_makers_deterministic(name: str) -> None:
    m1, in1 = MAKERS[name]()
    m2, in2 = MAKERS[name]()
    for a, b in zip(in1, in2, strict=True):
        assert torch.equal(a, b)
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2
        assert torch.equal(p1, p2), n1


def test_has_bottleneck_covers_makers() -> None:
    assert set(HAS_BOTTLENECK) == set(MAKERS)


def test_cola_llama_loss_scalar_and_backward() -> None:
    model = build("tiny")
    (ids,) = example_inputs(model.cfg, batch=2, seq=16)
    logits = model(ids)
    assert logits.shape == (2, 16, model.cfg.vocab_size)
    loss = model(ids, labels=ids)
    assert loss.ndim == 0
    assert torch.isfinite(loss)
    # the mean over the positions that have a next token: the logits sliced, as written
    # before next_token_loss shifted the labels instead
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(loss, ref)
    ignored = ids.clone()
    ignored[:, 5] = -100  # a label the loss must skip: position 4 has no target
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ignored[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(model(ids, labels=ignored), ref)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cola_llama_structure() -> None:
    model = build("tiny")
    cfg = model.cfg
    lowrank = [m for m in model.modules() if isinstance(m, LowRankLinear)]
    assert len(lowrank) == 7 * cfg.n_layers
    for m in lowrank:
        assert m.down.out_features == cfg.rank
        assert m.up.in_features == cfg.rank
    assert isinstance(model.embed, torch.nn.Embedding)
    assert model.lm_head.weight.shape == (cfg.vocab_size, cfg.d_model)
    assert model.lm_head.weight is not model.embed.weight


def test_tied_embeddings() -> None:
    model = build("tiny", tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    (ids,) = example_inputs(model.cfg, seq=8)
    assert torch.isfinite(model(ids, labels=ids))


def test_build_40b_on_meta() -> None:
    model = build("40b", device="meta")
    p = next(model.parameters())
    assert p.device.type == "meta"
    assert all(t.device.type == "meta" for t in model.parameters())
    assert all(t.device.type == "meta" for t in model.buffers())
    assert model.cfg.d_model == 8192 and model.cfg.rank == 2048


def test_meta_then_materialise() -> None:
    ref = build("tiny", seed=3)
    model = build("tiny", device="meta")
    model.to_empty(device="cpu")
    model.reset_parameters()
    torch.testing.assert_close(model.rope.cos, ref.rope.cos)
    torch.testing.assert_close(model.rope.sin, ref.rope.sin)
    (ids,) = example_inputs(ref.cfg, seq=8)
    assert torch.isfinite(model(ids)).all()


def test_presets() -> None:
    assert set(CONFIGS) >= {"tiny", "60m", "1b", "7b", "40b"}
    assert config("tiny") == ColaLlamaConfig()
    c = config("7b", n_layers=2)
    assert (c.d_model, c.d_ff, c.n_heads, c.rank, c.vocab_size) == (4096, 11008, 32, 1024, 32000)
    assert c.n_layers == 2
    assert CONFIGS["7b"].n_layers == 32  # presets are not mutated
    with pytest.raises(KeyError):
        config("nope")


def test_gqa_forward() -> None:
    model = gqa_cola()
    assert model.cfg.num_kv_heads == 2
    attn = model.layers[0].attn
    assert attn.k_proj.up.out_features == 2 * model.cfg.head_dim
    assert attn.q_proj.up.out_features == 4 * model.cfg.head_dim
    (ids,) = example_inputs(model.cfg, seq=8)
    assert torch.isfinite(model(ids)).all()


def test_gqa_matches_repeated_mha() -> None:
    """GQA with kv weights duplicated per group equals MHA (checks the head grouping)."""
    gqa = gqa_cola(n_layers=1)
    mha = build("tiny", n_layers=1, n_heads=4, n_kv_heads=4)
    sd = gqa.state_dict()
    hd = gqa.cfg.head_dim
    for name in ("k_proj", "v_proj"):
        key = f"layers.0.attn.{name}.up.weight"
        w = sd[key].view(2, hd, -1)  # [kv_heads, hd, r]
        sd[key] = w.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    (ids,) = example_inputs(gqa.cfg, seq=8)
    torch.testing.assert_close(gqa(ids), mha(ids))


def test_gqa_indivisible_heads_raises() -> None:
    with pytest.raises(ValueError, match=r"n_heads \(4\).*n_kv_heads \(3\)"):
        ColaLlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"\(4\).*\(3\)"):
        build("tiny", n_kv_heads=3)
    cfg = ColaLlamaConfig()
    cfg.n_kv_heads = 3  # mutated after construction: the model re-validates
    with pytest.raises(ValueError, match=r"\(4\).*\(3\)"):
        ColaLlama(cfg)


def test_cola_llama_fullgraph_capture() -> None:
    """The example must capture as a single graph (no graph breaks), with and without labels."""
    torch._dynamo.reset()
    model = build("tiny", n_layers=1)
    (ids,) = example_inputs(model.cfg, seq=8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(ids), model(ids))
    torch.testing.assert_close(compiled(ids, labels=ids), model(ids, labels=ids))
    torch._dynamo.reset()
