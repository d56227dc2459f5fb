"""Hugging Face families the first HF tests never named, at tp=2 (issue 16, part 1).

Qwen3 (an RMSNorm over each head's dim: ``q_norm``/``k_norm``) and Phi-3 (fused
``qkv_proj`` read back by slicing, ``qkv[..., :q_pos]``; fused ``gate_up_proj``
chunked), CoLA factors, against the same model on one device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.region_checks import _compare

_DIMS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
)  # fmt: skip


def build(family: str) -> torch.nn.Module:
    import transformers as tf

    import boost_compiler

    torch.manual_seed(0)
    if family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**_DIMS, head_dim=16))
    elif family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**_DIMS, pad_token_id=0, eos_token_id=1))
    else:
        raise KeyError(family)
    boost_compiler.to_low_rank(model, method="cola", multiple_of=8)
    return model.train()


def hf_family(family: str, *, world: int, mesh: Any) -> dict[str, Any]:
    import boost_compiler

    model = build(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, _DIMS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids, "use_cache": False})
    return {
        **_compare(model, ref, ids, world),
        "bottlenecks": len(model.boost_plan.bottlenecks),
        "fallbacks": list(model.boost_plan.fallbacks),
    }
