"""A small, single-device CoLA-LLaMA in plain PyTorch.

CoLA ("Compute-efficient pre-training of LLMs via Low-rank Activation") keeps the
LLaMA architecture but replaces every dense projection of a block (q, k, v, o of
attention and gate, up, down of the SwiGLU MLP) by a low-rank bottleneck

    y = up(silu(down(x)))        down: d_in -> rank,  up: rank -> d_out

with ``rank << d_in, d_out`` (``rank = d_model / 4`` in the paper's presets). The token
embedding and the LM head stay dense. Everything else is a standard pre-norm LLaMA:
RMSNorm, rotary position embeddings (RoPE), causal attention with optional
grouped-query attention (fewer key/value heads than query heads), and residual
connections.

This module is meant to be copied. It has no dependencies besides torch and avoids
data-dependent Python control flow, so ``torch.compile(model, backend="boost")``
captures each forward as one graph::

    from boost_compiler.models.cola_llama import build, example_inputs

    model = build("tiny")
    (ids,) = example_inputs(model.cfg, batch=2, seq=32)
    loss = torch.compile(model, backend="boost")(ids, labels=ids)
    loss.backward()

``build("7b", device="meta")`` constructs a model without allocating its weights
(useful for planning). Materialise it with ``model.to_empty(device=...)`` followed by
``model.reset_parameters()``: ``to_empty`` leaves the non-persistent RoPE buffers
uninitialised as well, and ``reset_parameters`` refills them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CONFIGS",
    "Attention",
    "Block",
    "ColaLlama",
    "ColaLlamaConfig",
    "LowRankLinear",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "build",
    "config",
    "example_inputs",
    "rotate_half",
]


@dataclass
class ColaLlamaConfig:
    """Hyper-parameters of a CoLA-LLaMA. ``n_kv_heads=None`` means ``n_kv_heads = n_heads``."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 172
    rank: int = 16
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads (``n_heads`` unless grouped-query attention is used)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        """Raise ValueError if the sizes are inconsistent."""
        if self.n_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) and n_kv_heads ({self.num_kv_heads}) must be positive"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.rank <= 0:
            raise ValueError(f"rank ({self.rank}) must be positive")


# Preset names follow the CoLA/BOOST papers: the size of the dense model with the same
# d_model/d_ff/layers. The low-rank models themselves are smaller (the "7b" preset has
# about 2.8B parameters, "40b" about 15.9B).
CONFIGS: dict[str, ColaLlamaConfig] = {
    "tiny": ColaLlamaConfig(),
    "60m": ColaLlamaConfig(
        vocab_size=32000,
        d_model=512,
        d_ff=1376,
        n_layers=8,
        n_heads=8,
        rank=128,
        max_seq_len=2048,
    ),
    "1b": ColaLlamaConfig(
        vocab_size=32000,
        d_model=2048,
        d_ff=5472,
        n_layers=24,
        n_heads=32,
        rank=512,
        max_seq_len=4096,
    ),
    "7b": ColaLlamaConfig(
        vocab_size=32000,
        d_model=4096,
        d_ff=11008,
        n_layers=32,
        n_heads=32,
        rank=1024,
        max_seq_len=4096,
    ),
    "40b": ColaLlamaConfig(
        vocab_size=32000,
        d_model=8192,
        d_ff=22016,
        n_layers=48,
        n_heads=64,
        rank=2048,
        max_seq_len=4096,
    ),
}


def config(name: str, **overrides: object) -> ColaLlamaConfig:
    """Return a copy of preset ``name`` (see ``CONFIGS``) with ``overrides`` applied."""
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides)


class LowRankLinear(nn.Module):
    """CoLA bottleneck ``y = up(silu(down(x)))`` replacing a dense ``d_in -> d_out`` linear."""

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.act = nn.SiLU()
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(x)))


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables ``cos, sin: [max_seq_len, head_dim]`` (non-persistent buffers)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        )
        pos = torch.arange(self.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_seq_len, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_seq_len, head_dim]
        return emb.cos(), emb.sin()

    def reset_parameters(self) -> None:
        """Recompute the tables in place (needed after ``to_empty``)."""
        cos, sin = self._tables()
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [b, heads, s, head_dim]`` by position; ``cos, sin: [s, head_dim]``."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


def _dropout(p: float) -> nn.Module:
    # Identity when p == 0 keeps a no-op dropout node out of the captured graph.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Attention(nn.Module):
    """Causal multi-head attention (optionally grouped-query) with low-rank q/k/v/o."""

    def __init__(self, cfg: ColaLlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        d, r, hd = cfg.d_model, cfg.rank, cfg.head_dim
        self.q_proj = LowRankLinear(d, self.n_heads * hd, r)
        self.k_proj = LowRankLinear(d, self.n_kv_heads * hd, r)
        self.v_proj = LowRankLinear(d, self.n_kv_heads * hd, r)
        self.o_proj = LowRankLinear(self.n_heads * hd, d, r)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:  # static: decided by the config
            groups = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with every projection low-rank."""

    def __init__(self, cfg: ColaLlamaConfig) -> None:
        super().__init__()
        d, f, r = cfg.d_model, cfg.d_ff, cfg.rank
        self.gate_proj = LowRankLinear(d, f, r)
        self.up_proj = LowRankLinear(d, f, r)
        self.down_proj = LowRankLinear(f, d, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm LLaMA block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ColaLlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.drop = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        x = x + self.drop(self.mlp(self.mlp_norm(x)))
        return x


class ColaLlama(nn.Module):
    """CoLA-LLaMA language model: dense embedding, low-rank blocks, final RMSNorm, dense head."""

    def __init__(self, cfg: ColaLlamaConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.drop = _dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._tie()

    def _tie(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
            # nn.Embedding's N(0, 1) init would give the tied head huge logits.
            with torch.no_grad():
                self.embed.weight.normal_(0.0, 0.02)  # LLaMA initializer_range

    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer (e.g. after ``to_empty``)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self._tie()  # to_empty() unties shared parameters: tie them again

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]``, or the mean next-token cross-entropy if ``labels`` is given."""
        s = input_ids.shape[1]
        cos, sin = self.rope(s)
        x = self.drop(self.embed(input_ids))
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return next_token_loss(logits, labels)


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of each position's logits ``[b, s, V]`` against the next
    position's label (``ignore_index``: none), over the positions that have one.

    The labels are shifted, not the logits, as transformers' ``ForCausalLMLoss`` does: the
    last position's label becomes ``ignore_index`` and the logits are read whole. Slicing
    them (``logits[:, :-1]``) gives the same mean but copies ``[b, s-1, V]`` and keeps
    Inductor from writing the loss's gradient into the logits' buffer: one process's step
    at V=32,000 took 1822 / 2172 / 1698 ms with the slice, 1739 / 2029 / 1653 with this
    (three alternating runs).
    """
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shifted.reshape(-1),
        ignore_index=ignore_index,
    )


def build(
    name: str = "tiny",
    device: torch.device | str | None = None,
    seed: int = 0,
    **overrides: object,
) -> ColaLlama:
    """Build preset ``name`` with ``overrides`` on ``device``, seeded by ``seed``.

    ``device="meta"`` allocates nothing (the parameters are shape-only meta tensors).
    """
    cfg = config(name, **overrides)
    torch.manual_seed(seed)
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        return ColaLlama(cfg)


def example_inputs(
    cfg: ColaLlamaConfig,
    batch: int = 2,
    seq: int = 32,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor]:
    """Random token ids ``[batch, seq]`` (deterministic for a given ``seed``), as a 1-tuple."""
    if seq > cfg.max_seq_len:
        raise ValueError(f"seq ({seq}) exceeds max_seq_len ({cfg.max_seq_len})")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return (ids.to(device) if device is not None else ids,)
