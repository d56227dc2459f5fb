"""LORO (mzf666/LORO-main, "Parameter and Memory Efficient Pretraining via Low-rank Riemannian
Optimization"): a Llama folder (``model_type`` ``"llama"``) whose projections hold
``weight_in`` / ``weight_out`` instead of ``weight``.

Where the mapping comes from (that repository, commit 4da57b6):

* ``loro_torch/lowrank_module.py``, ``LowRankLinear``: ``weight_in [in, r]``, ``weight_out
  [out, r]``, ``bias [out]``; ``forward``: ``x @ weight_in @ weight_out.T + bias``. So
  ``down.weight = weight_in^T``, ``up.weight = weight_out``, no activation: exact.
* ``apply_lowrank_param``: every ``nn.Linear`` under ``self_attn`` and/or ``mlp``
  (``--loro_scope`` all / attn / mlp; the others stay dense ``weight``), ranks
  ``--loro_attn_rank`` / ``--loro_mlp_rank`` (not in the config: read off the shapes here).
* ``run_c4.py`` builds ``peft_pretraining/modeling_llama.py`` (a transformers 4.28 Llama
  copy: RoPE base 10000 whatever the config says, its ``rotary_emb.inv_freq`` buffers saved
  with the weights) from ``configs/llama_*.json`` and saves it with ``save_pretrained``.
  Those buffers are checked against ``rope_theta`` 10000 and written back on export.
* Not read: ``loro_torch/lowrank_adpt_module.py``'s fine-tuning adapter (a frozen
  ``weight`` buffer beside the factors), which is not a pre-training checkpoint: a module
  with both is refused by name. Weights saved as ``pytorch_model.bin`` (transformers 4.31's
  default) must be re-saved as safetensors first (boost never unpickles).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import LayoutError
from .base import (
    SOURCE_KEY,
    Converted,
    Output,
    Source,
    layout_config,
    llama_config,
    llama_fields,
    low_rank_config,
    pair_spec,
    pop_rotary,
    require_rope,
    rotary_tensors,
    weights_dtype,
)
from .flat import export_pairs, import_pairs, no_leftover, pop_leaf

__all__ = ["LORO", "SOURCE", "detect", "read", "write"]

LORO = "loro"
SOURCE = ("mzf666/LORO-main: loro_torch/lowrank_module.py (LowRankLinear, apply_lowrank_param), "
          "peft_pretraining/modeling_llama.py, run_c4.py")  # fmt: skip
ROPE_THETA = 10000.0  # modeling_llama.py's LlamaRotaryEmbedding(base=10000), never the config's


def detect(source: Source) -> bool:
    return any(k.endswith(".weight_in") for k in source.keys)


def _to_pair(name: str, parts: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    if "weight" in parts:
        raise LayoutError(f"{LORO}: '{name}' holds 'weight' beside its factors: LORO's "
                          "fine-tuning adapter (lowrank_adpt_module.py), not a pre-training "
                          "checkpoint")  # fmt: skip
    w_in = pop_leaf(parts, "weight_in", name, LORO)
    w_out = pop_leaf(parts, "weight_out", name, LORO)
    bias = parts.pop("bias", None)
    no_leftover(parts, name, LORO)
    if w_in.dim() != 2 or w_out.dim() != 2 or w_in.shape[1] != w_out.shape[1]:
        raise LayoutError(f"{LORO}: '{name}.weight_in' {tuple(w_in.shape)} and "
                          f"'{name}.weight_out' {tuple(w_out.shape)} are not [in, r] and "
                          "[out, r]")  # fmt: skip
    pair = {"down.weight": w_in.t().contiguous(), "up.weight": w_out}
    if bias is not None:
        pair["up.bias"] = bias
    spec = pair_spec(w_in.shape[0], w_out.shape[0], w_in.shape[1], bias=bias is not None,
                     activation=None)  # fmt: skip
    return spec, pair


def _from_pair(name: str, spec: Any, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"weight_in": parts["down.weight"].t().contiguous(), "weight_out": parts["up.weight"]}
    if "up.bias" in parts:
        out["bias"] = parts["up.bias"]
    return out


def read(source: Source) -> Converted:
    config = source.configs.get("config.json")
    if config is None:
        raise LayoutError(f"{source.path}: no config.json, which a LORO folder holds")
    hf = llama_config({**config, "rope_theta": ROPE_THETA}, f"{source.path / 'config.json'}")
    tensors = source.tensors()
    rotary = pop_rotary(tensors, hf, LORO)
    state, modules = import_pairs(tensors, ("weight_in", "weight_out"), _to_pair)
    record = {"layout": LORO, "files": {"config.json": config}, "rotary_buffers": rotary}
    return Converted(low_rank_config(hf, modules, "loro", record), state)


def write(conv: Converted) -> Output:
    require_rope(conv, LORO, ROPE_THETA)
    tensors = export_pairs(conv, LORO, _from_pair, activation=None, sparse=False)
    made = {**llama_fields(conv.config), "rope_theta": ROPE_THETA, "model_type": "llama",
            "architectures": ["LlamaForCausalLM"]}  # fmt: skip
    config = layout_config(conv, LORO, "config.json", made)
    source = conv.config.get(SOURCE_KEY) or {}
    if source.get("layout") == LORO and source.get("rotary_buffers"):
        tensors.update(rotary_tensors(conv.config, weights_dtype(conv.state_dict)))
    return Output({"config.json": config}, tensors)
