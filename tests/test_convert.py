"""to_low_rank: dense projections -> bottlenecks the compiler detects, exact SVD, report."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import boost_compiler
from boost_compiler.convert import (
    LowRankLinear,
    PatternError,
    RankError,
    UnsupportedModuleError,
    to_low_rank,
)
from boost_compiler.tp.collectives import fake_process_group
from tests.extras import need


class Attn(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class Toy(nn.Module):
    """Embedding, one attention + MLP block, a head (optionally tied)."""

    def __init__(self, vocab: int = 96, d: int = 64, ff: int = 160, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.lm_head(self.norm(x))


PROJ = ["attn.q", "attn.k", "attn.v", "attn.o", "mlp.0", "mlp.2"]


def _ids(vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))


def _pairs(model: nn.Module, *args: object, **kw: object) -> set[tuple[str, str]]:
    return {(b.down, b.up) for b in boost_compiler.detect(model, args, kw or None)}


def _assert_detected(model: nn.Module, names: list[str], *args: object, **kw: object) -> None:
    found = _pairs(model, *args, **kw)
    missing = [n for n in names if (f"{n}.down.weight", f"{n}.up.weight") not in found]
    assert not missing, f"not detected: {missing}"


def _matrix(d_out: int, d_in: int, s: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(d_out, d_out, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))
    k = s.numel()
    return (u[:, :k] * s) @ v[:, :k].T


@pytest.mark.parametrize("r", [4, 16, 40])
def test_svd_error_is_eckart_young_bound(r: int) -> None:
    s = torch.logspace(1, -2, 48, dtype=torch.float64)  # known singular values
    w = _matrix(64, 48, s)
    lin = nn.Linear(48, 64)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = nn.Sequential(lin)
    x = torch.randn(5, 48)
    report = to_low_rank(model, rank=r, method="svd")
    bound = (s[r:].square().sum().sqrt() / s.square().sum().sqrt()).item()
    (layer,) = report.layers
    lr = model[0]
    uv = (lr.up.weight @ lr.down.weight).double()
    measured = (torch.linalg.matrix_norm(w - uv) / torch.linalg.matrix_norm(w)).item()
    print(f"r={r}: bound {bound:.6e} report {layer.rel_error:.6e} measured {measured:.6e}")
    assert isinstance(lr, LowRankLinear) and isinstance(lr.act, nn.Identity)
    assert abs(layer.rel_error - bound) <= 1e-5
    assert abs(measured - bound) <= 1e-5
    # bias on the up factor; y = x (UV)^T + b
    assert torch.allclose(model(x), x @ uv.float().T + lin.bias, atol=1e-5)


def test_svd_higher_rank_strictly_lower_error() -> None:
    torch.manual_seed(0)
    # trained-like: a decaying spectrum plus noise
    w = torch.randn(96, 8) @ torch.randn(8, 80) + 0.1 * torch.randn(96, 80)
    errors = []
    for r in (2, 4, 8, 16, 32, 64):
        lin = nn.Linear(80, 96)
        with torch.no_grad():
            lin.weight.copy_(w)
        model = nn.Sequential(lin)
        errors.append(to_low_rank(model, rank=r, method="svd").layers[0].rel_error)
    print("errors", errors)
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False))


def test_cola_detected_and_initialised() -> None:
    torch.manual_seed(0)
    model, ids = Toy(), _ids()
    report = to_low_rank(model)  # cola, rank_ratio 0.25
    assert report.converted == PROJ
    assert set(report.skipped) == {"lm_head"}
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.embed, nn.Embedding)
    assert all(isinstance(model.get_submodule(n).act, nn.SiLU) for n in PROJ)
    assert [x.rank for x in report.layers] == [16] * 6
    _assert_detected(model, PROJ, ids)
    model(ids).sum().backward()  # still trains
    # CoLA init: Var(up @ down) = 1 / (d_in + d_out), checked on a wide layer
    big = nn.Sequential(nn.Linear(1024, 1024))
    to_low_rank(big, rank=256)
    prod = big[0].up.weight @ big[0].down.weight
    assert prod.std().item() == pytest.approx(1 / math.sqrt(2048), rel=0.05)
    assert big[0].down.weight.std().item() == pytest.approx(math.sqrt(2048**-0.5 / 16), rel=0.05)


def test_include_exclude_and_multiple_of() -> None:
    model = Toy()
    report = to_low_rank(model, include="mlp", rank=8)  # a pattern covers descendants
    assert report.converted == ["mlp.0", "mlp.2"]
    assert isinstance(model.attn.q, nn.Linear)
    model = Toy()
    report = to_low_rank(model, exclude=["attn.[qk]", "mlp.2"])
    assert report.converted == ["attn.v", "attn.o", "mlp.0"]
    assert report.skipped["attn.q"].startswith("excluded")
    model = Toy(d=64, ff=100)
    report = to_low_rank(model, rank_ratio=0.3, multiple_of=8)  # 0.3 * 64 = 19.2 -> 16
    assert {x.rank for x in report.layers} == {16}
    # converting again finds only the factors and leaves them alone
    assert to_low_rank(model).converted == []


def test_heads_stay_dense_unless_named() -> None:
    tied = Toy(tie=True)
    report = to_low_rank(tied, include="*")
    assert "lm_head" not in report.converted
    assert "tied" in report.skipped["lm_head"]
    assert tied.lm_head.weight is tied.embed.weight
    with pytest.raises(UnsupportedModuleError, match="lm_head.*tied"):
        to_low_rank(Toy(tie=True), include="lm_head")
    untied = Toy()
    assert to_low_rank(untied, include="lm_head", rank=16).converted == ["lm_head"]


def test_report_totals_and_table() -> None:
    model = Toy()
    before = sum(p.numel() for p in model.parameters())
    report = to_low_rank(model, rank=16, method="svd")
    after = sum(p.numel() for p in model.parameters())
    assert (report.model_params_before, report.model_params_after) == (before, after)
    assert before - after == report.params_before - report.params_after
    q = report.layers[0]  # attn.q: 64 -> 16 -> 64 with bias
    assert (q.params_before, q.params_after) == (64 * 64 + 64, 16 * 128 + 64)
    assert (q.flops_before, q.flops_after) == (2 * 64 * 64, 2 * 16 * 128)
    assert report.flops_before == sum(2 * x.d_in * x.d_out for x in report.layers)
    assert report.flops_after == sum(2 * x.rank * (x.d_in + x.d_out) for x in report.layers)
    buf = io.StringIO()
    Console(file=buf, width=200).print(report)
    text = buf.getvalue()
    print(text)
    assert "attn.q" in text and "total" in text and "lm_head" in text
    assert f"{report.params_before:,} → {report.params_after:,}" in text
    assert f"{q.rel_error:.4f}" in text


def test_bad_input_names_the_module() -> None:
    with pytest.raises(RankError, match="attn.q"):
        to_low_rank(Toy(), rank=64)
    with pytest.raises(PatternError, match="nothere"):
        to_low_rank(Toy(), include="nothere.*")
    with pytest.raises(UnsupportedModuleError, match="'embed' .Embedding."):
        to_low_rank(Toy(), include="embed")
    mha = nn.Sequential(nn.MultiheadAttention(64, 4))
    with pytest.raises(UnsupportedModuleError, match="0.out_proj"):
        to_low_rank(mha, include="0.out_proj")
    assert list(to_low_rank(mha).skipped) == ["0.out_proj"]  # swept up: kept, with why
    with pytest.raises(ValueError, match="method"):
        to_low_rank(Toy(), method="tucker")
    with pytest.raises(ValueError, match="multiple"):
        to_low_rank(Toy(), rank=12, multiple_of=8)
    with fake_process_group(2):
        model = Toy()
        to_low_rank(model, rank=16)
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randint(0, 96, (2, 8)),))
        for part in (model, model.mlp):  # the model, or a part of it (holding shards)
            with pytest.raises(boost_compiler.errors.ConversionError, match="before parallelize"):
                to_low_rank(part)


# ---------------------------------------------------------------------------------
# Hugging Face models from tiny configs (random weights, no downloads)
# ---------------------------------------------------------------------------------


def _gpt2() -> nn.Module:
    tf = need("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(cfg)


def test_gpt2_conv1d_cola_detected_and_trains() -> None:
    model = _gpt2()
    ids = _ids()
    report = to_low_rank(model)
    names = [f"transformer.h.{i}.{m}" for i in range(2) for m in
             ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]  # fmt: skip
    assert report.converted == names
    assert {x.kind for x in report.layers} == {"Conv1D"}
    c_attn = report.layers[0]
    assert (c_attn.d_in, c_attn.rank, c_attn.d_out) == (64, 16, 192)  # fused q/k/v
    assert "tied" in report.skipped["lm_head"]
    _assert_detected(model, names, ids, labels=ids)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_gpt2_conv1d_svd_matches_transposed_weight() -> None:
    """Conv1D stores ``[in, out]``: the factors must give ``up @ down == weight.T``.

    Every Conv1D gets an exactly rank-16 weight first, so the rank-16 SVD is exact and
    the factors can be checked element by element (an error norm cannot: ``W`` and
    ``W^T`` share their singular values). Non-square (``c_attn`` 64x192,
    ``mlp.c_proj`` 256x64) and square (``attn.c_proj`` 64x64, where a dropped
    transpose would still have the right shape) alike; the logits stay those of the
    dense model.
    """
    model = _gpt2()
    g = torch.Generator().manual_seed(2)
    dense = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod).__name__ == "Conv1D":
                d_in, d_out = mod.weight.shape
                w = torch.randn(d_in, 16, generator=g) @ torch.randn(16, d_out, generator=g)
                mod.weight.copy_(w / 4)
                dense[name] = (mod.weight.clone(), mod.bias.clone())
    ids = _ids()
    model.eval()  # no dropout: the logits before and after are comparable
    before = model(ids).logits.detach()
    report = to_low_rank(model, method="svd", rank=16)
    assert sorted(report.converted) == sorted(dense)
    shapes = {tuple(w.shape) for w, _ in dense.values()}
    assert (64, 64) in shapes and (64, 192) in shapes and (256, 64) in shapes
    for name, (w, b) in dense.items():
        lr = model.get_submodule(name)
        uv = lr.up.weight @ lr.down.weight  # [out, in]
        err = ((uv - w.T).abs().max() / w.abs().max()).item()
        print(f"{name} {tuple(w.shape)}: max |up @ down - W^T| / max |W| = {err:.1e}")
        assert err <= 1e-5, name
        assert torch.equal(lr.up.bias, b), name
    after = model(ids).logits.detach()
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-4  # fp32 rounding
    assert all(layer.rel_error <= 1e-5 for layer in report.layers)


def test_falcon_linear_converts_exactly_at_full_rank() -> None:
    """Falcon's ``FalconLinear`` (an ``nn.Linear`` subclass computing ``x @ W.T + b``) is on
    the allowlist: every projection converts, and where the weights have the rank kept the
    logits are the dense model's. Any other subclass still stays dense, named."""
    tf = need("transformers")
    torch.manual_seed(0)
    cfg = tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=96, new_decoder_architecture=False, multi_query=True,
                          bias=True)  # fmt: skip
    model = tf.FalconForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # rank-16 weights: the rank-16 SVD is exact
        for mod in model.modules():
            if type(mod).__name__ == "FalconLinear":
                d_out, d_in = mod.weight.shape
                mod.weight.copy_(
                    torch.randn(d_out, 16, generator=g) @ torch.randn(16, d_in, generator=g) / 8
                )
    ids = _ids()
    before = model(ids).logits.detach()
    report = to_low_rank(model, method="svd", rank=16)
    kinds = {type(model.get_submodule(n)).__name__ for n in report.converted}
    assert len(report.converted) == 8 and kinds == {"LowRankLinear"}, report.converted
    assert not [n for n, why in report.skipped.items() if "subclass" in why], report.skipped
    after = model(ids).logits.detach()
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-4

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert "own behaviour" in to_low_rank(nn.Sequential(Scaled(64, 64))).skipped["0"]


def test_llama_cola_detected_and_trains() -> None:
    tf = need("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(cfg)
    ids = _ids()
    report = to_low_rank(model, multiple_of=8)
    proj = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in proj]
    assert report.converted == names
    assert list(report.skipped) == ["lm_head"]
    assert all(x.rank % 8 == 0 for x in report.layers)
    _assert_detected(model, names, ids, labels=ids)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------
# The head by role, not by sizes that coincide (V = 4d, n_positions = d)
# ---------------------------------------------------------------------------------

GPT2_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_coinciding_sizes_convert_every_projection(tied: bool) -> None:
    """HF GPT-2 with ``vocab_size = 4 * n_embd`` and ``n_positions = n_embd``: each block's
    ``mlp.c_fc`` maps ``d`` onto the token table's row count, ``attn.c_proj`` onto the
    positions table's. The model names its head (``get_output_embeddings()``), so sizes
    decide nothing: all 8 projections are converted, ``lm_head`` alone stays dense."""
    tf = need("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=128, n_positions=128, vocab_size=512, n_head=4, bos_token_id=0,
        eos_token_id=0, tie_word_embeddings=tied,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg)
    report = to_low_rank(model, rank_ratio=0.25)
    assert report.converted == [f"transformer.h.{i}.{m}" for i in range(2) for m in GPT2_LAYERS]
    assert list(report.skipped) == ["lm_head"]
    assert ("tied" if tied else "get_output_embeddings") in report.skipped["lm_head"]
    assert type(model.lm_head) is nn.Linear
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_proj = nn.Linear(d, d)  # d -> d: the positions table's rows below
        self.c_fc = nn.Linear(d, 4 * d)  # d -> 4d: the token table's rows below
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(x) + self.down(F.gelu(self.c_fc(x)))


class _NoHfGpt(nn.Module):
    """A GPT without Hugging Face's methods: untied head, V = 4d, n_positions = d.

    ``stack``: the blocks as a ``ModuleList`` or, as torchtitan keeps them, a
    ``ModuleDict``.
    """

    def __init__(self, d: int = 32, stack: str = "list") -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(4 * d, d), nn.Embedding(d, d)
        blocks = [_Block(d) for _ in range(2)]
        self.h: nn.Module = (
            nn.ModuleList(blocks) if stack == "list"
            else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )  # fmt: skip
        self.lm_head = nn.Linear(d, 4 * d, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h.values() if isinstance(self.h, nn.ModuleDict) else self.h:
            x = block(x)
        return self.lm_head(x)


@pytest.mark.parametrize("stack", ["list", "dict"])
def test_head_by_structure_ignores_blocks_and_position_tables(stack: str) -> None:
    """No ``get_output_embeddings``: the head is the one layer outside the stacked blocks
    mapping a token table's width onto its rows; the blocks' layers of the same sizes
    are converted."""
    model = _NoHfGpt(stack=stack)
    report = to_low_rank(model, rank=8)
    blocks = [f"h.{i}.{m}" for i in range(2) for m in ("c_proj", "c_fc", "down")]
    assert report.converted == blocks
    assert list(report.skipped) == ["lm_head"] and "'wte'" in report.skipped["lm_head"]


def test_head_by_structure_two_candidates_is_no_head(caplog: pytest.LogCaptureFixture) -> None:
    """Two ``d -> V`` layers outside the blocks: ambiguous, neither is called the head
    (both converted), and the log says so."""
    model = _NoHfGpt()
    model.aux = nn.Linear(32, 128, bias=False)
    with caplog.at_level("WARNING", logger="boost_compiler.convert"):
        report = to_low_rank(model, rank=8)
    assert {"lm_head", "aux"} <= set(report.converted) and not report.skipped
    assert "'aux'" in caplog.text and "'lm_head'" in caplog.text
