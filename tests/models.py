"""Test-only model variants for bottleneck detection and sharding.

Every model is tiny and fp32. Construction draws from the global RNG, so a model is
deterministic given ``torch.manual_seed``; each ``make_<name>(seed=0)`` seeds it and
returns ``(model, example_inputs_tuple)``. ``MAKERS`` maps names to these functions.

Which variants contain a low-rank bottleneck (a d -> r contraction, elementwise ops
or a norm over r, an r -> d' contraction, with r smaller than both sides):

    cola_llama, cola_ref_layout, gpt2_svd, gqa_cola, svd_pair, fused_qkv_up   yes
    addmm_bias (HF Conv1D's torch.addmm(bias, x, W))                          yes
    norm_between (a latent chain, as MLA's)                                   yes
    dense                                                                     no

(``HAS_BOTTLENECK`` records the same.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from examples.cola_llama import ColaLlama, build

__all__ = [
    "HAS_BOTTLENECK",
    "MAKERS",
    "AddmmBottleneck",
    "ColaLayer",
    "ColaRefLayout",
    "Dense",
    "FusedQkvUp",
    "Gpt2Svd",
    "NormBetween",
    "SvdPair",
    "gqa_cola",
    "make_addmm_bias",
    "make_cola_llama",
    "make_cola_ref_layout",
    "make_dense",
    "make_fused_qkv_up",
    "make_gpt2_svd",
    "make_gqa_cola",
    "make_norm_between",
    "make_svd_pair",
]

BATCH = 2
SEQ = 8


def _token_ids(vocab: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


# --------------------------------------------------------------------------------------
# CoLA reference-code layout: raw factor parameters used with matmul, no nn.Linear.
# --------------------------------------------------------------------------------------


class ColaLayer(nn.Module):
    """CoLA projection as in the reference code: ``silu(x @ cola_a) @ cola_b``.

    ``cola_a: [d_in, r]`` and ``cola_b: [r, d_out]`` are raw parameters (note: stored
    transposed relative to ``nn.Linear.weight``).
    """

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.cola_a = nn.Parameter(torch.randn(d_in, rank) / math.sqrt(d_in))
        self.cola_b = nn.Parameter(torch.randn(rank, d_out) / math.sqrt(rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(F.silu(x @ self.cola_a), self.cola_b)


class _RefRMSNorm(nn.Module):
    """RMSNorm written out by hand (no ``torch.rms_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class _RefAttention(nn.Module):
    """HF-style eager attention: hard-coded head count, RoPE from positions, explicit mask."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.num_heads = 4  # hard-coded, as in HF configs copied into modules
        self.head_dim = hidden // self.num_heads
        self.q_proj = ColaLayer(hidden, hidden, rank)
        self.k_proj = ColaLayer(hidden, hidden, rank)
        self.v_proj = ColaLayer(hidden, hidden, rank)
        self.o_proj = ColaLayer(hidden, hidden, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        # RoPE computed in forward from positions (no buffers).
        inv_freq = 1.0 / (
            10000.0 ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim)
        )
        pos = torch.arange(s, device=x.device).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        probs = torch.softmax(scores + mask, dim=-1)
        y = torch.matmul(probs, v)
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(y)


class _RefMLP(nn.Module):
    def __init__(self, hidden: int, ff: int, rank: int) -> None:
        super().__init__()
        self.gate_proj = ColaLayer(hidden, ff, rank)
        self.up_proj = ColaLayer(hidden, ff, rank)
        self.down_proj = ColaLayer(ff, hidden, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _RefBlock(nn.Module):
    def __init__(self, hidden: int, ff: int, rank: int) -> None:
        super().__init__()
        self.input_layernorm = _RefRMSNorm(hidden)
        self.self_attn = _RefAttention(hidden, rank)
        self.post_attention_layernorm = _RefRMSNorm(hidden)
        self.mlp = _RefMLP(hidden, ff, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ColaRefLayout(nn.Module):
    """Small LLaMA in CoLA's reference-code layout (``ColaLayer`` with raw ``cola_a/cola_b``).

    Hand-written RMSNorm, HF-style ``self.num_heads = 4`` used in ``.view``, eager
    attention with RoPE computed from positions. Input ``[b, s]`` token ids, output logits.
    """

    def __init__(
        self, vocab: int = 128, hidden: int = 64, ff: int = 128, rank: int = 16, layers: int = 2
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_RefBlock(hidden, ff, rank) for _ in range(layers))
        self.norm = _RefRMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def make_cola_ref_layout(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    model = ColaRefLayout()
    return model, (_token_ids(128),)


# --------------------------------------------------------------------------------------
# GPT-2 with SVD-style (no activation) low-rank factors.
# --------------------------------------------------------------------------------------


class _SvdLinear(nn.Module):
    """SVD-style factor pair ``up(down(x))``; bias on the up factor only by default."""

    def __init__(self, d_in: int, d_out: int, rank: int, down_bias: bool = False) -> None:
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=down_bias)
        self.up = nn.Linear(rank, d_out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class _Gpt2Attention(nn.Module):
    def __init__(self, d: int, n_head: int, rank: int, down_bias: bool) -> None:
        super().__init__()
        self.d = d
        self.n_head = n_head
        self.head_dim = d // n_head
        self.c_attn = _SvdLinear(d, 3 * d, rank, down_bias)  # fused q/k/v: ONE up factor
        self.c_proj = _SvdLinear(d, d, rank, down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(self.d, dim=-1)
        q = q.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.d))


class _Gpt2Mlp(nn.Module):
    def __init__(self, d: int, rank: int, down_bias: bool) -> None:
        super().__init__()
        self.c_fc = _SvdLinear(d, 4 * d, rank, down_bias)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = _SvdLinear(4 * d, d, rank, down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class _Gpt2Block(nn.Module):
    def __init__(self, d: int, n_head: int, rank: int, down_bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _Gpt2Attention(d, n_head, rank, down_bias)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = _Gpt2Mlp(d, rank, down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2Svd(nn.Module):
    """GPT-2 with SVD-style low-rank projections (no activation inside a factor pair).

    LayerNorm with bias, learned positional embedding, fused q/k/v from one
    ``down: d -> r`` / ``up: r -> 3d`` pair split into three, low-rank output projection,
    MLP ``d -> 4d -> d`` with GELU between the two low-rank projections. Up factors have
    biases; down factors have one only if ``down_bias``. ``tied=True`` computes the LM head
    as ``F.linear(h, self.wte.weight)``.
    """

    def __init__(
        self,
        vocab: int = 128,
        d: int = 64,
        n_head: int = 4,
        rank: int = 16,
        layers: int = 2,
        max_pos: int = 64,
        tied: bool = True,
        down_bias: bool = False,
    ) -> None:
        super().__init__()
        self.tied = tied
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_pos, d)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        self.h = nn.ModuleList(_Gpt2Block(d, n_head, rank, down_bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = None if tied else nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        h = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(h, self.wte.weight)
        return self.lm_head(h)


def make_gpt2_svd(seed: int = 0, **kw: object) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    model = Gpt2Svd(**kw)  # type: ignore[arg-type]
    return model, (_token_ids(128),)


# --------------------------------------------------------------------------------------
# Bottlenecks written as HF's Conv1D computes them: torch.addmm(bias, x, W).
# --------------------------------------------------------------------------------------


class _AddmmLinear(nn.Module):
    """HF's ``Conv1D``: weight ``[d_in, d_out]``, ``y = addmm(bias, x, W)`` on 2-D rows."""

    def __init__(self, d_in: int, d_out: int, beta: float = 1.0, alpha: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)
        # Keywords only when not the default: the plain call is the one HF writes.
        self.scale = {k: v for k, v in (("beta", beta), ("alpha", alpha)) if v != 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight, **self.scale)
        return y.view(*x.shape[:-1], -1)


class AddmmBottleneck(nn.Module):
    """Embedding, two ``d -> r -> d`` bottlenecks of :class:`_AddmmLinear` (biases on the
    down and the up factor), a dense head.

    The embedding splits the hidden stream, so each down factor is row-parallel with a
    bias: the partial product is summed over the ranks, then the bias added once.
    ``beta``/``alpha`` on the down factors make them no plain ``x @ W + b``.
    """

    def __init__(
        self, vocab: int = 96, d: int = 64, rank: int = 16, beta: float = 1.0, alpha: float = 1.0
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.down1, self.up1 = _AddmmLinear(d, rank, beta, alpha), _AddmmLinear(rank, d)
        self.down2, self.up2 = _AddmmLinear(d, rank, beta, alpha), _AddmmLinear(rank, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.up1(F.silu(self.down1(h)))
        h = h + self.up2(F.gelu(self.down2(h)))
        return self.head(self.norm(h))


def make_addmm_bias(seed: int = 0, **kw: float) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return AddmmBottleneck(**kw), (_token_ids(96),)


def make_addmm_scaled(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`AddmmBottleneck` with ``beta=0.5, alpha=2.0`` on its down factors."""
    return make_addmm_bias(seed, beta=0.5, alpha=2.0)


# --------------------------------------------------------------------------------------
# Grouped-query CoLA-LLaMA (from the example).
# --------------------------------------------------------------------------------------


def gqa_cola(**kw: object) -> ColaLlama:
    """CoLA-LLaMA with grouped-query attention: 4 query heads sharing 2 key/value heads."""
    params: dict[str, object] = dict(d_model=64, n_heads=4, n_kv_heads=2, rank=16, n_layers=2)
    params.update(kw)
    return build("tiny", **params)


def make_cola_llama(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The example's "tiny" CoLA-LLaMA (multi-head attention)."""
    model = build("tiny", seed=seed)
    torch.manual_seed(seed)
    return model, (_token_ids(model.cfg.vocab_size),)


def make_gqa_cola(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = gqa_cola(seed=seed)
    torch.manual_seed(seed)
    return model, (_token_ids(model.cfg.vocab_size),)


# --------------------------------------------------------------------------------------
# Single-layer patterns.
# --------------------------------------------------------------------------------------


class SvdPair(nn.Module):
    """``nn.Sequential(Linear(d, r, bias=False), Linear(r, d))``: SVD bottleneck, no activation."""

    def __init__(self, d: int = 64, rank: int = 16) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, d, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


class FusedQkvUp(nn.Module):
    """``down: d -> r``, SiLU, ``up: r -> 3d`` split into q, k, v; returns ``q * k + v``."""

    def __init__(self, d: int = 64, rank: int = 16) -> None:
        super().__init__()
        self.d = d
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, 3 * d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(F.silu(self.down(x)))
        q, k, v = y.split(self.d, -1)
        return q * k + v


class Dense(nn.Module):
    """Pre-norm dense MLP block ``x + fc2(gelu(fc1(ln(x))))``, ``d -> 4d -> d``: no bottleneck."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class NormBetween(nn.Module):
    """``down: d -> r``, LayerNorm(r), ``up: r -> d``.

    The norm reduces over r, so it is not elementwise; under BTP r is replicated
    after the down factor's all-reduce, so it is local: a latent chain (like
    DeepSeek's MLA, ``kind="latent"``), not a plain factor pair.
    """

    def __init__(self, d: int = 64, rank: int = 16) -> None:
        super().__init__()
        self.down = nn.Linear(d, rank, bias=False)
        self.norm = nn.LayerNorm(rank)
        self.up = nn.Linear(rank, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.norm(self.down(x)))


class WeightReadFirst(nn.Module):
    """Factor weights read whole before their layer runs: ``w.abs().mean()`` of a down
    factor as a scale, ``w.norm()`` of an up factor as a divisor.

    The first reader fixes the weight replicated; the layer after it must still get
    its split (a slice of the replicated weight), not the whole matrix on a shard.
    """

    def __init__(self, d: int = 64, rank: int = 16) -> None:
        super().__init__()
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, d, bias=False)
        self.down2 = nn.Linear(d, rank, bias=False)
        self.up2 = nn.Linear(rank, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.down.weight.abs().mean()
        n = self.up2.weight.norm()
        h = x + self.up(self.down(x)) * scale
        return h + self.up2(self.down2(h)) / n


class DropoutCola(nn.Module):
    """Embedding, two bottlenecks with dropout on the r-dim latent AND on the hidden shard.

    Returns ``(logits, latent, dropped)``: the latent is replicated under BTP
    (its mask must be one mask on every rank), ``dropped`` a hidden-shard
    tensor (its masks must differ between shards).
    """

    def __init__(self, vocab: int = 96, d: int = 64, rank: int = 16, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.embed = nn.Embedding(vocab, d)
        self.down1, self.up1 = nn.Linear(d, rank, bias=False), nn.Linear(rank, d, bias=False)
        self.down2, self.up2 = nn.Linear(d, rank, bias=False), nn.Linear(rank, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.embed(ids)
        latent = F.dropout(F.silu(self.down1(h)), self.p, self.training)
        dropped = F.dropout(self.up1(latent), self.p, self.training)
        h = h + dropped
        h = h + self.up2(F.silu(self.down2(h)))
        return self.head(h), latent, dropped


def _hidden(d: int = 64) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, d)


def make_svd_pair(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return SvdPair(), (_hidden(),)


def make_fused_qkv_up(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return FusedQkvUp(), (_hidden(),)


def make_dense(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return Dense(), (_hidden(),)


def make_norm_between(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return NormBetween(), (_hidden(),)


MAKERS: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "cola_llama": make_cola_llama,
    "cola_ref_layout": make_cola_ref_layout,
    "gpt2_svd": make_gpt2_svd,
    "addmm_bias": make_addmm_bias,
    "gqa_cola": make_gqa_cola,
    "svd_pair": make_svd_pair,
    "fused_qkv_up": make_fused_qkv_up,
    "dense": make_dense,
    "norm_between": make_norm_between,
}

# Whether each variant contains at least one low-rank bottleneck.
HAS_BOTTLENECK: dict[str, bool] = {
    "cola_llama": True,
    "cola_ref_layout": True,
    "gpt2_svd": True,
    "addmm_bias": True,
    "gqa_cola": True,
    "svd_pair": True,
    "fused_qkv_up": True,
    "dense": False,
    "norm_between": True,
}


# --------------------------------------------------------------------------------------
# Hugging Face decoders from tiny configs (random weights, no downloads), converted.
# --------------------------------------------------------------------------------------

HF_VOCAB = 96
_HF_DECODER_DIMS: dict[str, object] = dict(
    hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=HF_VOCAB, max_position_embeddings=32,
)  # fmt: skip


def hf_decoder(family: str, attn: str = "sdpa", **overrides: object) -> nn.Module:
    """A dense ``<Family>ForCausalLM`` (llama, qwen2, mistral, gpt2) from a tiny config.

    Grouped-query attention (4 query, 2 key/value heads) for the LLaMA-like
    families; Qwen2 adds biases on q/k/v. GPT-2: fused ``c_attn`` (``Conv1D``),
    tied LM head, learned positions, dropout off (a random mask would differ
    between the single-device reference and the parallel run). The model is in
    training mode, the cache on (HF's defaults).
    """
    import transformers as tf  # the optional [hf] extra

    if family == "gpt2":
        dims = dict(
            n_embd=64, n_layer=2, n_head=4, vocab_size=HF_VOCAB, n_positions=32,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(tf.GPT2Config(**{**dims, **overrides}, attn_implementation=attn))
    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    cfg_cls, model_cls = classes[family]
    return model_cls(cfg_cls(**{**_HF_DECODER_DIMS, **overrides}, attn_implementation=attn))


def make_hf(
    seed: int = 0, family: str = "llama", attn: str = "sdpa", layers: int = 2, method: str = "cola"
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`hf_decoder` with ``layers`` blocks, converted by ``to_low_rank(multiple_of=8)``.

    ``multiple_of=8`` keeps every rank divisible by the TP degrees tested (2, 4).
    """
    import boost_compiler

    torch.manual_seed(seed)
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    model = hf_decoder(family, attn, **{key: layers})
    boost_compiler.to_low_rank(model, method=method, multiple_of=8)
    return model, (_token_ids(HF_VOCAB),)


# A dense GPT-2 whose sizes coincide where a shape rule would be fooled (V = 4 d, the
# positions table's rows = d) and whose plan at tp=2 runs Conv1D's ``addmm`` row-parallel.
GPT2_DENSE_DIMS: dict[str, int] = dict(
    n_embd=128, n_layer=2, n_head=4, n_positions=128, vocab_size=512
)


def make_hf_dense(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """HF GPT-2 from :data:`GPT2_DENSE_DIMS` as it comes, no conversion: no bottleneck.

    The embedding splits the hidden stream, so some ``Conv1D`` (``torch.addmm(bias, x,
    W)``) contracts the hidden shard with its weight split on the input dim:
    row-parallel with a bias, which a converted model only meets on its down factors
    (there ``nn.Linear`` without bias).
    """
    torch.manual_seed(seed)
    model = hf_decoder("gpt2", "sdpa", **GPT2_DENSE_DIMS)
    return model, (_token_ids(GPT2_DENSE_DIMS["vocab_size"]),)


def svd_sequential(model: nn.Module, rank_ratio: float = 0.25, multiple_of: int = 8) -> list[str]:
    """Factor ``model``'s ``nn.Linear`` layers into ``nn.Sequential(Linear, Linear)`` pairs.

    What third-party SVD compression code produces (truncated SVD, ``down`` without
    bias, the bias on ``up``), written independently of ``to_low_rank`` so that
    the compiler meets a layout it did not create. The output head and any
    linear tied to an embedding stay dense. Returns the converted module names.
    """
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or name.endswith("lm_head") or id(mod.weight) in tied:
            continue
        d_out, d_in = mod.weight.shape
        r = int(rank_ratio * min(d_in, d_out)) // multiple_of * multiple_of
        u, s, vh = torch.linalg.svd(mod.weight.detach(), full_matrices=False)
        pair = nn.Sequential(
            nn.Linear(d_in, r, bias=False), nn.Linear(r, d_out, bias=mod.bias is not None)
        )
        with torch.no_grad():
            pair[0].weight.copy_(s[:r, None].sqrt() * vh[:r])
            pair[1].weight.copy_(u[:, :r] * s[:r].sqrt())
            if mod.bias is not None:
                pair[1].bias.copy_(mod.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, pair)
        names.append(name)
    return names


def make_hf_svd_sequential(
    seed: int = 0, family: str = "llama", attn: str = "sdpa"
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`hf_decoder` with its projections factored by :func:`svd_sequential`."""
    torch.manual_seed(seed)
    model = hf_decoder(family, attn)
    svd_sequential(model)
    return model, (_token_ids(HF_VOCAB),)


# --------------------------------------------------------------------------------------
# LaX: latent crossing between consecutive layers.
# --------------------------------------------------------------------------------------


class LaxProj(nn.Module):
    """A CoLA pair whose up factor also reads the previous layer's latent (LaX).

    ``h_i = silu(down_i(x_i))`` is this layer's r-dim latent and
    ``y_i = up_i(h_i + h_{i-1})``; ``forward`` returns ``(y_i, h_i)`` so the
    caller hands ``h_i`` to the same projection of the next layer.
    """

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(
        self, x: torch.Tensor, prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.silu(self.down(x))
        return self.up(h if prev is None else h + prev), h


class _LaxBlock(nn.Module):
    NAMES = ("q", "k", "v", "o", "gate", "up", "down")

    def __init__(self, d: int, ff: int, heads: int, rank: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        dims = {"gate": (d, ff), "up": (d, ff), "down": (ff, d)}
        self.proj = nn.ModuleDict(
            {n: LaxProj(*dims.get(n, (d, d)), rank) for n in self.NAMES}  # type: ignore[misc]
        )

    def forward(
        self, x: torch.Tensor, prev: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        latents: dict[str, torch.Tensor] = {}

        def proj(name: str, inp: torch.Tensor) -> torch.Tensor:
            y, latents[name] = self.proj[name](inp, prev.get(name))
            return y

        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            proj(n, h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for n in "qkv"
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + proj("o", att.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        x = x + proj("down", F.silu(proj("gate", h)) * proj("up", h))
        return x, latents


class LaxLlama(nn.Module):
    """A small CoLA-LLaMA with LaX latent crossing between consecutive blocks.

    Every projection of block i adds the latent of the same projection of block
    i-1 before its up factor. The crossing edges are r-wide element-wise
    dataflow between bottlenecks of different layers: the compiler must keep
    the latents replicated across them, as BOOST's boundaries already are.
    """

    def __init__(
        self, vocab: int = 96, d: int = 64, ff: int = 160, heads: int = 4, rank: int = 16,
        layers: int = 3,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_LaxBlock(d, ff, heads, rank) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        latents: dict[str, torch.Tensor] = {}
        for block in self.blocks:
            x, latents = block(x, latents)
        return self.lm_head(self.norm(x))


def make_lax(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return LaxLlama(), (_token_ids(96),)


def make_weight_read_first(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return WeightReadFirst(), (_hidden(),)
