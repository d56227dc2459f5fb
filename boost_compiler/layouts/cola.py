"""CoLA and CoLA-M (alvin-zyl/CoLA, "CoLA: Compute-Efficient Pre-Training of LLMs via
Low-Rank Activation"): Hugging Face folders with ``model_type`` ``"cola"`` / ``"cola_m"``.

Where the mapping comes from (that repository, commit 91ff0d1):

* ``cola/cola_layer.py``, ``ColaLayer``: ``cola_a [in, r]``, ``cola_b [r, out]``, ``bias
  [out]``; ``forward``: ``out = lr_act(x @ cola_a) @ cola_b + bias``. So ``down.weight =
  cola_a^T``, ``up.weight = cola_b^T``, ``up.bias = bias``, SiLU between: exact (transposes).
* ``cola/modeling_cola.py``: every projection of the Llama block (q, k, v, o, gate, up,
  down) is a ``ColaLayer`` whose ``lr_act_type`` is ``config.hidden_act`` (the config's
  ``lr_act_type`` field is not read there); ``ColaMLP`` computes
  ``down(act_fn(gate(x)) * up(x))``, or ``down(gate(x) * up(x))`` with ``only_lr_act``:
  transformers' ``LlamaMLP`` with ``hidden_act`` ``"silu"``, resp. ``"linear"``. Norms,
  RoPE, attention, embeddings and head are transformers' Llama under its own names. k and
  v project onto ``num_heads * head_dim`` (multi-head attention only).
* ``cola/configuration_cola.py``: ``ColaConfig(LlamaConfig)`` adds ``rank`` (default
  ``hidden_size // 4``), ``lr_act_type`` and ``only_lr_act`` (default True; the shipped
  ``cola_configs/*.json`` set it false).
* ``cola/modeling_colam.py`` (CoLA-M, the same model with memory-saving checkpoints): each
  ``ColaLayer`` split into ``ColaMDownProjLayer`` (``cola_a``, then the activation) and
  ``ColaMUpProjLayer`` (``cola_b``, ``bias``) held by other modules, and the MLP's down
  projection "shifted by one layer": its up half is applied at the start of the next
  decoder layer (``layers.{i+1}.last_layer_post_mlp.post_down_proj``), the last layer's by
  its own ``post_mlp``. :data:`_COLAM` lists the renames.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import LayoutError
from .base import (
    ATTN,
    MLP,
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
)
from .flat import export_pairs, import_pairs, layer_projections, no_leftover, pop_leaf

__all__ = ["COLA", "COLA_M", "SOURCE", "detect", "detect_m", "read_cola", "read_cola_m",
           "write_cola", "write_cola_m"]  # fmt: skip

COLA, COLA_M = "cola", "cola-m"
SOURCE = ("alvin-zyl/CoLA: cola/cola_layer.py (ColaLayer, ColaMDownProjLayer, ColaMUpProjLayer), "
          "cola/modeling_cola.py, cola/modeling_colam.py, cola/configuration_cola.py")  # fmt: skip
MODEL_TYPE = {COLA: "cola", COLA_M: "cola_m"}
ARCHITECTURE = {COLA: "ColaForCausalLM", COLA_M: "ColaMForCausalLM"}

# CoLA-M module -> CoLA module, within one decoder layer (modeling_colam.py's attributes).
_COLAM: dict[str, str] = {
    **{f"pre_attn.pre_{p}.cola_a": f"self_attn.{p}.cola_a" for p in ATTN[:3]},
    **{f"self_attn.post_{p}.{leaf}": f"self_attn.{p}.{leaf}"
       for p in ATTN[:3] for leaf in ("cola_b", "bias")},
    "self_attn.pre_o_proj.cola_a": "self_attn.o_proj.cola_a",
    **{f"post_attn.post_o_proj.{leaf}": f"self_attn.o_proj.{leaf}" for leaf in ("cola_b", "bias")},
    **{f"pre_mlp.pre_{p}.cola_a": f"mlp.{p}.cola_a" for p in MLP[:2]},
    **{f"self_mlp.post_{p}.{leaf}": f"mlp.{p}.{leaf}"
       for p in MLP[:2] for leaf in ("cola_b", "bias")},
    "self_mlp.pre_down_proj.cola_a": "mlp.down_proj.cola_a",
}  # fmt: skip
# The down projection's up half: in the next layer, or in the last layer's post_mlp.
_SHIFTED = {f"last_layer_post_mlp.post_down_proj.{leaf}": f"mlp.down_proj.{leaf}"
            for leaf in ("cola_b", "bias")}  # fmt: skip
_LAST = {f"post_mlp.post_down_proj.{leaf}": f"mlp.down_proj.{leaf}" for leaf in ("cola_b", "bias")}
_TO_COLAM = {cola: colam for colam, cola in _COLAM.items()}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def detect(source: Source) -> bool:
    return source.configs.get("config.json", {}).get("model_type") == "cola" or (
        any(k.endswith(".cola_a") for k in source.keys) and not detect_m(source)
    )


def detect_m(source: Source) -> bool:
    return source.configs.get("config.json", {}).get("model_type") == "cola_m" or any(
        ".pre_attn.pre_q_proj." in k for k in source.keys
    )


def _from_colam(key: str, n_layers: int) -> str:
    m = _LAYER.match(key)
    if m is None:
        return key
    i, rest = int(m[1]), m[2]
    if rest in _COLAM:
        return f"model.layers.{i}.{_COLAM[rest]}"
    if rest in _SHIFTED and i > 0:
        return f"model.layers.{i - 1}.{_SHIFTED[rest]}"
    if rest in _LAST and i == n_layers - 1:
        return f"model.layers.{i}.{_LAST[rest]}"
    return key


def _to_colam(key: str, n_layers: int) -> str:
    m = _LAYER.match(key)
    if m is None:
        return key
    i, rest = int(m[1]), m[2]
    if rest in _TO_COLAM:
        return f"model.layers.{i}.{_TO_COLAM[rest]}"
    if rest.startswith("mlp.down_proj.") and rest in _SHIFTED.values():
        leaf = rest.rpartition(".")[2]
        if i == n_layers - 1:
            return f"model.layers.{i}.post_mlp.post_down_proj.{leaf}"
        return f"model.layers.{i + 1}.last_layer_post_mlp.post_down_proj.{leaf}"
    return key


def _to_pair(layout: str) -> Any:
    def convert(name: str, parts: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
        a = pop_leaf(parts, "cola_a", name, layout)
        b = pop_leaf(parts, "cola_b", name, layout)
        bias = parts.pop("bias", None)
        no_leftover(parts, name, layout)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise LayoutError(f"{layout}: '{name}.cola_a' {tuple(a.shape)} and '{name}.cola_b' "
                              f"{tuple(b.shape)} are not [in, r] and [r, out]")  # fmt: skip
        pair = {"down.weight": a.t().contiguous(), "up.weight": b.t().contiguous()}
        if bias is not None:
            pair["up.bias"] = bias
        spec = pair_spec(a.shape[0], b.shape[1], a.shape[1], bias=bias is not None,
                         activation="silu")  # fmt: skip
        return spec, pair

    return convert


def _from_pair(name: str, spec: Any, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"cola_a": parts["down.weight"].t().contiguous(),
           "cola_b": parts["up.weight"].t().contiguous()}  # fmt: skip
    if "up.bias" in parts:
        out["bias"] = parts["up.bias"]
    return out


def _read(source: Source, layout: str) -> Converted:
    where = f"{source.path / 'config.json'} ({layout})"
    config = source.configs.get("config.json")
    if config is None:
        raise LayoutError(f"{source.path}: no config.json, which a {layout} folder holds")
    act = config.get("hidden_act", "silu")
    if act != "silu":  # ColaLayer's activation is hidden_act; LowRankLinear has SiLU or none
        raise LayoutError(f"{where}: hidden_act {act!r}: CoLA's factors would use it between "
                          "them; boost's factor pairs have SiLU or no activation")  # fmt: skip
    only = bool(config.get("only_lr_act", True))  # ColaConfig's default
    hf = llama_config({**config, "hidden_act": "linear" if only else act}, where)
    if hf["num_key_value_heads"] != hf["num_attention_heads"]:
        raise LayoutError(f"{where}: num_key_value_heads {hf['num_key_value_heads']}: CoLA's "
                          "k_proj / v_proj project onto all heads")  # fmt: skip
    tensors = source.tensors()
    if layout == COLA_M:
        n = hf["num_hidden_layers"]
        tensors = {_from_colam(k, n): v for k, v in tensors.items()}
    state, modules = import_pairs(tensors, ("cola_a", "cola_b"), _to_pair(layout))
    missing = [p for p in layer_projections(hf["num_hidden_layers"]) if p not in modules]
    if missing:
        raise LayoutError(f"{layout}: no factors for {missing[:4]}: every projection of a CoLA "
                          "model is a ColaLayer")  # fmt: skip
    record = {"layout": layout, "files": {"config.json": config}}
    return Converted(low_rank_config(hf, modules, "cola", record), state)


def read_cola(source: Source) -> Converted:
    return _read(source, COLA)


def read_cola_m(source: Source) -> Converted:
    return _read(source, COLA_M)


def _write(conv: Converted, layout: str) -> Output:
    cfg = conv.config
    n = cfg["num_hidden_layers"]
    names = layer_projections(n)
    tensors = export_pairs(conv, layout, _from_pair, activation="silu", sparse=False,
                           required=names)  # fmt: skip
    rank = common_rank(pairs_of(conv, layout), names, layout, "CoLA's projections (one `rank`)")
    act = cfg.get("hidden_act")
    if act not in ("silu", "linear"):
        raise LayoutError(f"{layout}: the model's MLP activation {act!r} is neither CoLA's "
                          "SiLU nor its only_lr_act (none)")  # fmt: skip
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    if kv != heads:
        raise LayoutError(f"{layout}: {kv} key/value heads for {heads} query heads: CoLA's "
                          "k_proj / v_proj project onto all heads (no grouped-query attention)")  # fmt: skip
    made = {**llama_fields(cfg), "model_type": MODEL_TYPE[layout],
            "architectures": [ARCHITECTURE[layout]], "rank": rank,
            "only_lr_act": act == "linear", "hidden_act": "silu"}  # fmt: skip
    config = layout_config(conv, layout, "config.json", made)
    if layout == COLA_M:
        tensors = {_to_colam(k, n): v for k, v in tensors.items()}
    return Output({"config.json": config}, tensors)


def write_cola(conv: Converted) -> Output:
    return _write(conv, COLA)


def write_cola_m(conv: Converted) -> Output:
    return _write(conv, COLA_M)
