"""The BOOST reference's Nanotron checkpoints (``boost-nanotron``): a CoLA Llama in Nanotron's
names, its factors grouped the way its bottleneck-aware TP computes them.

Where the mapping comes from:

* Nanotron (huggingface/nanotron, commit 2411b022): the checkpoint folder
  (``serialize/weights.py``: ``model/`` tree of per-tensor safetensors, TP shards with
  their slices; ``model_config.json`` beside it, ``constants.py``), the names outside the
  decoder layers and the config fields (``examples/llama/convert_weights.py``:
  ``model.token_position_embeddings.pp_block.token_embedding.weight``,
  ``model.decoder.{i}.pp_block.{input_layernorm,post_attention_layernorm}.weight``,
  ``model.final_layer_norm.pp_block.weight``, ``model.lm_head.pp_block.weight``; the config
  fields are transformers' names), and RoPE: ``rope_interleaved`` pairs even/odd features
  (GPT-J) where transformers pairs halves (GPT-NeoX); ``examples/llama/
  convert_nanotron_to_hf.py`` permutes q and k rows per head for it, as done here on the
  up factors' rows (a permutation: exact).
* The BOOST fork's factor names: the issue text (``attn.qkv_proj0`` holding the three down
  factors ``[3r, d]``, ``q_proj1``, ``kv_proj1``, ``o_proj0/1``, ``mlp.gate_up_proj0/1``,
  ``down_proj0/1``) and the fork's weight-copy and parity scripts as found in the public
  code index (the repository itself was not found): ``proj0`` the down factor as an
  ``[r, in]`` linear weight, SiLU (``lr_act``) between, ``proj1`` the up factor ``[out, r]``;
  grouped siblings as ``BatchedTensorParallelColumnLinear`` weights ``[n, out, r]``
  (``gate_up_proj1 [2, d_ff, r]``; those scripts show ``qkv_proj1 [3, out, r]``, which is
  read too). ``kv_proj1`` is taken as ``[2, n_kv * head_dim, r]`` (k then v), the batched
  form of the k and v up factors; its exact shape in the fork was not seen. The MLP is
  Nanotron's ``act(gate) * up`` (CoLA's ``only_lr_act: false``; ``true`` is honoured).
* Not modelled: the fork's default per-shard ("local") RMSNorm, which at TP > 1 is not the
  single-device norm; what is imported is the single-device model (its ``sync`` and
  ``online`` norm modes).
"""

from __future__ import annotations

import torch

from ..errors import LayoutError
from .base import (
    SOURCE_KEY,
    Converted,
    Output,
    Source,
    common_rank,
    layout_config,
    llama_config,
    llama_fields,
    low_rank_config,
    pair_spec,
    pairs_of,
    require,
    take,
)
from .flat import layer_projections

__all__ = ["NANOTRON", "SOURCE", "detect", "read", "write"]

NANOTRON = "boost-nanotron"
SOURCE = ("huggingface/nanotron: serialize/weights.py, examples/llama/convert_weights.py, "
          "convert_nanotron_to_hf.py; the BOOST fork's qkv_proj0 / q_proj1 / kv_proj1 / "
          "o_proj0/1 / gate_up_proj0/1 / down_proj0/1 (issue text, its parity scripts)")  # fmt: skip
_OUTSIDE = {
    "model.token_position_embeddings.pp_block.token_embedding.weight": "model.embed_tokens.weight",
    "model.final_layer_norm.pp_block.weight": "model.norm.weight",
    "model.lm_head.pp_block.weight": "lm_head.weight",
}
_NORMS = ("input_layernorm", "post_attention_layernorm")


def detect(source: Source) -> bool:
    return any(k.endswith(".attn.qkv_proj0.weight") for k in source.keys)


def _dims(hf: dict) -> tuple[int, int, int, int, int]:
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    hd = hf.get("head_dim") or d // heads
    return d, hf["intermediate_size"], heads * hd, (hf.get("num_key_value_heads") or heads) * hd, hd


def _rope_perm(rows: int, head_dim: int) -> torch.Tensor:
    """Nanotron's interleaved-RoPE row order -> transformers' (per head: evens, then odds)."""
    head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return torch.cat([head + h * head_dim for h in range(rows // head_dim)])


def _split(t: torch.Tensor, parts: int, key: str) -> list[torch.Tensor]:
    if t.shape[0] % parts:
        raise LayoutError(f"{NANOTRON}: '{key}' has {t.shape[0]} rows, not {parts} equal factors")
    return [c.contiguous() for c in t.chunk(parts, dim=0)]


def _attn(t: dict, p: str, hf: dict, interleaved: bool) -> dict[str, torch.Tensor]:
    d, _, q_out, kv_out, hd = _dims(hf)
    downs = _split(take(t, f"{p}.attn.qkv_proj0.weight", NANOTRON), 3, f"{p}.attn.qkv_proj0.weight")
    r = downs[0].shape[0]
    if f"{p}.attn.qkv_proj1.weight" in t:  # the fork's parity scripts' form (MHA)
        ups = list(take(t, f"{p}.attn.qkv_proj1.weight", NANOTRON, (3, q_out, r)).unbind(0))
    else:
        kv = take(t, f"{p}.attn.kv_proj1.weight", NANOTRON, (2, kv_out, r))
        ups = [take(t, f"{p}.attn.q_proj1.weight", NANOTRON, (q_out, r)), *kv.unbind(0)]
    if interleaved:
        ups[0], ups[1] = ups[0][_rope_perm(q_out, hd)], ups[1][_rope_perm(kv_out, hd)]
    out = {}
    for name, down, up in zip(("q_proj", "k_proj", "v_proj"), downs, ups, strict=True):
        out[f"self_attn.{name}.down.weight"] = down
        out[f"self_attn.{name}.up.weight"] = up.contiguous()
    o_down = take(t, f"{p}.attn.o_proj0.weight", NANOTRON)
    out["self_attn.o_proj.down.weight"] = o_down
    out["self_attn.o_proj.up.weight"] = take(t, f"{p}.attn.o_proj1.weight", NANOTRON,
                                             (d, o_down.shape[0]))  # fmt: skip
    return out


def _mlp(t: dict, p: str, hf: dict) -> dict[str, torch.Tensor]:
    d, ff, *_ = _dims(hf)
    downs = _split(take(t, f"{p}.mlp.gate_up_proj0.weight", NANOTRON), 2,
                   f"{p}.mlp.gate_up_proj0.weight")  # fmt: skip
    ups = take(t, f"{p}.mlp.gate_up_proj1.weight", NANOTRON, (2, ff, downs[0].shape[0]))
    down0 = take(t, f"{p}.mlp.down_proj0.weight", NANOTRON)
    return {
        "mlp.gate_proj.down.weight": downs[0], "mlp.gate_proj.up.weight": ups[0].contiguous(),
        "mlp.up_proj.down.weight": downs[1], "mlp.up_proj.up.weight": ups[1].contiguous(),
        "mlp.down_proj.down.weight": down0,
        "mlp.down_proj.up.weight": take(t, f"{p}.mlp.down_proj1.weight", NANOTRON,
                                        (d, down0.shape[0])),
    }  # fmt: skip


def read(source: Source) -> Converted:
    config = source.configs.get("model_config.json")
    if config is None:
        raise LayoutError(f"{source.path}: no model_config.json, which Nanotron writes beside "
                          "model/ (its LlamaConfig)")  # fmt: skip
    if config.get("hidden_act", "silu") != "silu":
        raise LayoutError(f"{source.path / 'model_config.json'}: hidden_act "
                          f"{config['hidden_act']!r}; the fork's lr_act is SiLU")  # fmt: skip
    only = bool(config.get("only_lr_act", False))
    hf = llama_config({**config, "hidden_act": "linear" if only else "silu"},
                      f"{source.path / 'model_config.json'}")  # fmt: skip
    t = source.tensors()
    state = {hf_key: t.pop(nt_key) for nt_key, hf_key in _OUTSIDE.items() if nt_key in t}
    interleaved = bool(config.get("rope_interleaved", False))
    for i in range(hf["num_hidden_layers"]):
        p, q = f"model.decoder.{i}.pp_block", f"model.layers.{i}"
        for norm in _NORMS:
            state[f"{q}.{norm}.weight"] = take(t, f"{p}.{norm}.weight", NANOTRON)
        parts = {**_attn(t, p, hf, interleaved), **_mlp(t, p, hf)}
        state.update({f"{q}.{k}": v for k, v in parts.items()})
    if t:
        raise LayoutError(f"{NANOTRON}: tensors the layout does not have: {sorted(t)[:6]}")
    modules = {}
    for name in layer_projections(hf["num_hidden_layers"]):
        down, up = state[f"{name}.down.weight"], state[f"{name}.up.weight"]
        modules[name] = pair_spec(down.shape[1], up.shape[0], down.shape[0], bias=False,
                                  activation="silu")  # fmt: skip
    record = {"layout": NANOTRON, "files": {"model_config.json": config},
              "qkv_up": "qkv" if any(".attn.qkv_proj1." in k for k in source.keys) else "q_kv"}  # fmt: skip
    return Converted(low_rank_config(hf, modules, "cola", record), state)


# Nanotron's LlamaConfig fields (config/models_config.py), and the fork's ranks.
_NT_FIELDS = ("bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
              "intermediate_size", "max_position_embeddings", "num_attention_heads",
              "num_hidden_layers", "attention_bias", "num_key_value_heads", "pad_token_id",
              "rms_norm_eps", "rope_scaling", "rope_theta", "tie_word_embeddings", "use_cache",
              "vocab_size")  # fmt: skip
_SINGLE = {"self_attn.o_proj": "attn.o_proj", "mlp.down_proj": "mlp.down_proj"}


def _layer_out(sd: dict, i: int, hf: dict, interleaved: bool, qkv: bool) -> dict:
    """Layer ``i``'s tensors in the fork's names, removed from ``sd``."""
    p, q = f"model.decoder.{i}.pp_block", f"model.layers.{i}"
    _, _, q_out, kv_out, hd = _dims(hf)
    out = {f"{p}.{norm}.weight": sd.pop(f"{q}.{norm}.weight") for norm in _NORMS}
    a = [sd.pop(f"{q}.self_attn.{n}.down.weight") for n in ("q_proj", "k_proj", "v_proj")]
    u = [sd.pop(f"{q}.self_attn.{n}.up.weight") for n in ("q_proj", "k_proj", "v_proj")]
    if interleaved:  # back to Nanotron's row order: the inverse permutation
        u[0] = u[0][torch.argsort(_rope_perm(q_out, hd))]
        u[1] = u[1][torch.argsort(_rope_perm(kv_out, hd))]
    out[f"{p}.attn.qkv_proj0.weight"] = torch.cat(a)
    if qkv:
        out[f"{p}.attn.qkv_proj1.weight"] = torch.stack(u)
    else:
        out[f"{p}.attn.q_proj1.weight"] = u[0]
        out[f"{p}.attn.kv_proj1.weight"] = torch.stack(u[1:])
    gate_up = ("mlp.gate_proj", "mlp.up_proj")
    out[f"{p}.mlp.gate_up_proj0.weight"] = torch.cat(
        [sd.pop(f"{q}.{n}.down.weight") for n in gate_up]
    )
    out[f"{p}.mlp.gate_up_proj1.weight"] = torch.stack(
        [sd.pop(f"{q}.{n}.up.weight") for n in gate_up]
    )
    for name, nt in _SINGLE.items():
        out[f"{p}.{nt}0.weight"] = sd.pop(f"{q}.{name}.down.weight")
        out[f"{p}.{nt}1.weight"] = sd.pop(f"{q}.{name}.up.weight")
    return out


def _ranks(conv: Converted) -> tuple[int, int]:
    """(attn_rank, mlp_rank), after checking every projection is a pair the fork can hold."""
    names = layer_projections(conv.config["num_hidden_layers"])
    pairs = pairs_of(conv, NANOTRON)
    for name in names:
        spec = require(pairs, name, NANOTRON, "silu", sparse=False)
        if spec["bias"]:
            raise LayoutError(f"{NANOTRON}: '{name}' has a bias; the fork's factors have none")
    extra = sorted(set(pairs) - set(names))
    if extra:
        raise LayoutError(f"{NANOTRON}: {extra[:3]} are factored; the fork factors only the "
                          "decoder layers' projections")  # fmt: skip
    attn = common_rank(pairs, [n for n in names if ".self_attn." in n], NANOTRON,
                       "the attention projections (one attn_rank)")  # fmt: skip
    mlp = common_rank(pairs, [n for n in names if ".mlp." in n], NANOTRON,
                      "the MLP projections (one mlp_rank)")  # fmt: skip
    return attn, mlp


def write(conv: Converted) -> Output:
    cfg = conv.config
    attn_rank, mlp_rank = _ranks(conv)
    d, _, q_out, _, hd = _dims(cfg)
    if hd * cfg["num_attention_heads"] != d:
        raise LayoutError(f"{NANOTRON}: head_dim {hd} x {cfg['num_attention_heads']} heads is "
                          f"not hidden_size {d}; Nanotron's config has no head_dim")  # fmt: skip
    act = cfg.get("hidden_act")
    if act not in ("silu", "linear"):
        raise LayoutError(f"{NANOTRON}: MLP activation {act!r}: the fork's is SiLU")
    fields = llama_fields(cfg)
    made = {k: fields[k] for k in _NT_FIELDS if k in fields}
    made.update(hidden_act="silu", is_llama_config=True, rope_interleaved=False,
                pretraining_tp=1, attn_rank=attn_rank, mlp_rank=mlp_rank)  # fmt: skip
    if act == "linear":
        made["only_lr_act"] = True
    config = layout_config(conv, NANOTRON, "model_config.json", made)
    record = cfg.get(SOURCE_KEY) or {}
    qkv = record.get("layout") == NANOTRON and record.get("qkv_up") == "qkv"
    sd = dict(conv.state_dict)
    tensors = {nt: sd.pop(hf) for nt, hf in _OUTSIDE.items() if hf in sd}
    if cfg.get("tie_word_embeddings"):  # Nanotron saves a tied weight once, as the embedding
        tensors.pop("model.lm_head.pp_block.weight", None)
    for i in range(cfg["num_hidden_layers"]):
        tensors.update(_layer_out(sd, i, cfg, bool(config.get("rope_interleaved")), qkv))
    if sd:
        raise LayoutError(f"{NANOTRON}: tensors the layout has no key for: {sorted(sd)[:6]}")
    sharded = frozenset(k for k in tensors if not any(f".{n}." in k for n in _NORMS)
                        and k != "model.final_layer_norm.pp_block.weight")  # fmt: skip
    return Output({"model_config.json": config}, tensors, tree=True, sharded=sharded)
