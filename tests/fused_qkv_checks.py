"""Checks of tests/test_fused_qkv.py: fused q/k/v projections read back per head (issue 44, 5).

Three layouts in a 2-layer low-rank LM (:mod:`tests.gather_checks`' ``TinyLM``), each
written as its authors write it and the gather-free way (separate q, k and v
projections, the same attention): Bloom's per-head interleaved ``[H, 3, hd]`` read with
``view`` and ``[..., i, :]``, its heads merged into the batch (``reshape(b * H, s, hd)``)
for an ALiBi ``baddbmm`` and a ``bmm``; Falcon's multi-query ``[q heads; k; v]`` read
as ``view(b, s, H + 2, hd)`` and ``[..., :-2, :]`` / ``[..., [-2], :]`` / ``[..., [-1], :]``
with rotary's ``rotate_half``; GPT-BigCode's multi-query ``unsqueeze(1).split(..., dim=3)``.
And the Hugging Face families themselves (Bloom, Falcon in its three layouts,
GPT-BigCode multi-query), CoLA-converted, through HF's own loss.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.gather_checks import LAYERS, LowRank, rotate_halves, train_layers
from tests.zoo_checks import _train, _wire

D, HEADS, HD, V = 64, 4, 16, 256
FUSED = {"bloom": "bloom_separate", "falcon_mqa": "falcon_mqa_separate",
         "bigcode_mqa": "bigcode_mqa_separate"}  # fmt: skip


def _alibi(b: int, s: int) -> torch.Tensor:
    """Bloom's ALiBi bias, ``[b * H, 1, s]`` (heads of each sequence contiguous)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, HEADS + 1, dtype=torch.float32) / HEADS)
    return (slopes[:, None, None] * torch.arange(s, dtype=torch.float32)).repeat(b, 1, 1)


class Attention(nn.Module):
    """One of the layouts of :data:`FUSED`, fused or (``*_separate``) not."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.layout = how.removesuffix("_separate")
        n_kv = HEADS if self.layout == "bloom" else 1
        if how.endswith("_separate"):
            self.q, self.k, self.v = LowRank(D, D), LowRank(D, n_kv * HD), LowRank(D, n_kv * HD)
        else:
            self.qkv = LowRank(D, D + 2 * n_kv * HD)
        self.o = LowRank(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = getattr(self, "_" + self.how)(x, b, s)
        return x + self.o(y)

    def _bloom(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        fused = self.qkv(x).view(b, s, HEADS, 3, HD)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        q = q.reshape(b * HEADS, s, HD)
        k = k.reshape(b * HEADS, s, HD).transpose(-1, -2)
        v = v.reshape(b * HEADS, s, HD)
        scores = _alibi(b, s).baddbmm(batch1=q, batch2=k, beta=1.0, alpha=1 / math.sqrt(HD))
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        w = scores.view(b, HEADS, s, s).masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.bmm(w.view(b * HEADS, s, s), v).view(b, HEADS, s, HD)
        return y.permute(0, 2, 1, 3).reshape(b, s, D)

    def _bloom_separate(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        q, k, v = (t(x).view(b, s, HEADS, HD).transpose(1, 2) for t in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(HD) + _alibi(b, s).view(b, HEADS, 1, s)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        w = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return (w @ v).transpose(1, 2).reshape(b, s, D)

    def _falcon_mqa(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        fused = self.qkv(x).view(b, s, HEADS + 2, HD)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        return self._mqa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), b, s, True)

    def _falcon_mqa_separate(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        q, k, v = (t(x).view(b, s, -1, HD).transpose(1, 2) for t in (self.q, self.k, self.v))
        return self._mqa(q, k, v, b, s, True)

    def _bigcode_mqa(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).split((D, HD, HD), dim=3)
        return self._mqa(q.view(b, s, -1, HD).transpose(1, 2), k, v, b, s, False)

    def _bigcode_mqa_separate(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        q = self.q(x).view(b, s, -1, HD).transpose(1, 2)
        return self._mqa(q, self.k(x).unsqueeze(1), self.v(x).unsqueeze(1), b, s, False)

    @staticmethod
    def _mqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, s: int, rope: bool):
        if rope:
            q, k = rotate_halves(q), rotate_halves(k)
        k, v = (t.expand(b, HEADS, s, HD) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, D)


def pattern(name: str, lowering: str | None, *, world: int, mesh: Any) -> dict[str, Any]:
    """3 SGD steps at tp=2 of the layout ``name``; ``lowering``: compiled so, None: eager."""
    return train_layers(lambda: Attention(name), lowering, world=world, mesh=mesh)


# family -> (config class, model class, config kwargs): hidden 64, 4 heads, 2 layers.
_NO_DROP = dict(hidden_dropout=0.0, attention_dropout=0.0)
_FALCON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               bos_token_id=0, eos_token_id=0, **_NO_DROP)  # fmt: skip
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, bos_token_id=0,
                   eos_token_id=0, pad_token_id=0, **_NO_DROP)),
    "falcon_mha": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, multi_query=False, new_decoder_architecture=False)),
    "falcon_mqa": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, multi_query=True, new_decoder_architecture=False)),
    "falcon_new": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2)),
    "bigcode_mqa": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                         multi_query=True, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)),
}  # fmt: skip


def build_family(family: str) -> torch.nn.Module:
    """The family from its tiny config, CoLA-converted (as the zoo's), in training mode."""
    import transformers as tf

    import boost_compiler

    cfg_name, model_name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, cfg_name)(**kwargs))
    boost_compiler.to_low_rank(model, method="cola", multiple_of=8)
    return model.train()


def hf_family(family: str, compiled: bool = False, *, world: int, mesh: Any) -> dict[str, Any]:
    """The family at tp=2 against one device (HF's loss, 3 SGD steps), and its wire."""
    import boost_compiler

    model = build_family(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids, "use_cache": False}
    boost_compiler.parallelize(model, mesh, (ids,), kwargs)
    plan = model.boost_plan
    run = torch.compile(model, backend="boost") if compiled else model
    run(ids, **kwargs)
    wire = _wire(lambda: run(ids, **kwargs))
    sent = [(name, shape) for name, shape in wire if name != "gloo:barrier"]
    errs = _train(model, ref, ids, world, steps=3, lr=1e-3, run=run)
    return {
        **errs,
        "fallbacks": list(plan.fallbacks),
        "forward_wire": sent,
        "kinds": dict(Counter(name for name, _ in sent)),
        "bytes_per_layer": 4 * sum(math.prod(shape) for _, shape in sent) / LAYERS,
    }
