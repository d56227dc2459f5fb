"""SLTrain (andyjm3/SLTrain, "SLTrain: a sparse plus low-rank approach for parameter and
memory efficient pretraining"): a Llama folder plus ``splora_config.json``, each projection
``W = B A * lora_alpha / r + S`` with ``S`` sparse on a fixed random support.

Where the mapping comes from (that repository, commit 2335d62):

* ``splora/splora_linear.py``, ``SpLoRaLinear``: ``lora_A [r, in]``, ``lora_B [out, r]``,
  ``sparse_value [nnz]`` (a parameter), ``sparse_index [nnz]`` (a buffer: flat positions in
  ``[out, in]``), ``bias [out]``, and ``scaling [1]`` when ``trainable_scaling`` (then the
  scale is ``tanh(scaling)``, else ``lora_alpha / r``). ``forward`` passes
  ``lora_A * scale`` to ``sparse-lora/sparse_linear.cpp``, which computes
  ``W = lora_B @ (lora_A * scale)``, ``W.view(-1).scatter_add_(0, sparse_index,
  sparse_value)``, ``y = x @ W^T + bias``.
* ``splora/splora_model.py``, ``SpLoRaModel``: every ``nn.Linear`` whose name contains
  ``attn``, ``mlp`` or ``attention`` (``torchrun_main.py``'s target modules: all seven
  projections of a Llama layer) with one ``r``; ``save_pretrained`` writes the wrapped
  Llama's weights and ``splora_config.json`` (``r``, ``lora_alpha``, ``lora_dropout``,
  ``sp_ratio``, ``target_modules``). The Llama is ``peft_pretraining/modeling_llama.py``
  (RoPE base 10000, ``rotary_emb.inv_freq`` saved with the weights).

The mapping: ``down.weight = lora_A * scale`` (the very product SLTrain's forward forms, so
bit for bit its value), ``up.weight = lora_B``, no activation, and the sparse part kept
exact beside the pair (:class:`~boost_compiler.sparse.SparsePart`: ``S`` dense with its
support as a mask). The forward sums ``x A'^T B^T + x S^T`` where SLTrain forms ``B A' + S``
first: equal up to float rounding (about 1e-7 relative). Export divides by the scale
(``lora_A = down / scale``: within an ulp of the value read) and writes the support as
sorted ``sparse_index`` (SLTrain sorts its draw). Training then moves ``A * scale`` where
SLTrain moves ``A``: the same function of the same values, another parametrization (the
step of ``A`` would be ``1 / scale`` times as large under SGD).

TP cost of the sparse part: see :mod:`boost_compiler.sparse` (a dense ``[out, in]`` term
whose partial ``[b, s, out]`` output is reduced beside the bottleneck's ``[b, s, r]``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import LayoutError
from ..sparse import from_entries, to_entries
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
    pop_rotary,
    require,
    require_rope,
    rotary_tensors,
    weights_dtype,
)
from .flat import export_pairs, import_pairs, layer_projections, no_leftover, pop_leaf

__all__ = ["SLTRAIN", "SOURCE", "detect", "read", "write"]

SLTRAIN = "sltrain"
SOURCE = ("andyjm3/SLTrain: splora/splora_linear.py (SpLoRaLinear), sparse-lora/sparse_linear.cpp "
          "(sparse_linear_forward), splora/splora_model.py (SpLoRaModel, splora_config.json)")  # fmt: skip
ROPE_THETA = 10000.0  # peft_pretraining/modeling_llama.py's rotary base
TARGETS = ["attn", "mlp", "attention"]  # torchrun_main.py's target_modules_list


def detect(source: Source) -> bool:
    return "splora_config.json" in source.configs or any(
        k.endswith(".sparse_value") for k in source.keys
    )


def _to_pair(splora: dict[str, Any], scalings: dict[str, float]) -> Any:
    def convert(name: str, parts: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
        a = pop_leaf(parts, "lora_A", name, SLTRAIN)
        b = pop_leaf(parts, "lora_B", name, SLTRAIN)
        value = pop_leaf(parts, "sparse_value", name, SLTRAIN)
        index = pop_leaf(parts, "sparse_index", name, SLTRAIN)
        bias, scaling = parts.pop("bias", None), parts.pop("scaling", None)
        no_leftover(parts, name, SLTRAIN)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LayoutError(f"{SLTRAIN}: '{name}.lora_A' {tuple(a.shape)} and '{name}.lora_B' "
                              f"{tuple(b.shape)} are not [r, in] and [out, r]")  # fmt: skip
        if value.shape != index.shape or index.is_floating_point():
            raise LayoutError(f"{SLTRAIN}: '{name}.sparse_index' must be integer positions, one "
                              f"per '{name}.sparse_value'")  # fmt: skip
        out_f, in_f, r = b.shape[0], a.shape[1], a.shape[0]
        if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < out_f * in_f:
            raise LayoutError(f"{SLTRAIN}: '{name}.sparse_index' leaves [0, {out_f * in_f})")
        if scaling is not None:  # trainable_scaling: tanh(scaling), a tensor, as SLTrain does
            scalings[name] = float(scaling.reshape(-1)[0])
            down = a * scaling.tanh()
        else:
            down = a * _scale(splora, r, name)
        weight, mask = from_entries(index, value, (out_f, in_f))
        pair = {"down.weight": down, "up.weight": b, "sparse.weight": weight, "sparse.mask": mask}
        if bias is not None:
            pair["up.bias"] = bias
        spec = pair_spec(in_f, out_f, r, bias=bias is not None, activation=None, sparse=True)
        return spec, pair

    return convert


def _scale(splora: dict[str, Any], r: int, name: str) -> float:
    if "lora_alpha" not in splora or "r" not in splora:
        raise LayoutError(f"{SLTRAIN}: '{name}' scales its factors by lora_alpha / r, which "
                          "splora_config.json gives; the folder has none")  # fmt: skip
    if splora["r"] != r:
        raise LayoutError(f"{SLTRAIN}: splora_config.json says r={splora['r']}, "
                          f"'{name}.lora_A' has rank {r}")  # fmt: skip
    return splora["lora_alpha"] / splora["r"]  # a Python float, as SpLoRaLinear.scaling is


def read(source: Source) -> Converted:
    config = source.configs.get("config.json")
    if config is None:
        raise LayoutError(f"{source.path}: no config.json, which an SLTrain folder holds")
    splora = source.configs.get("splora_config.json", {})
    hf = llama_config({**config, "rope_theta": ROPE_THETA}, f"{source.path / 'config.json'}")
    tensors = source.tensors()
    rotary = pop_rotary(tensors, hf, SLTRAIN)
    scalings: dict[str, float] = {}
    state, modules = import_pairs(tensors, ("lora_A", "lora_B"), _to_pair(splora, scalings))
    files = {"config.json": config, **({"splora_config.json": splora} if splora else {})}
    record = {"layout": SLTRAIN, "files": files, "rotary_buffers": rotary, "scaling": scalings}
    return Converted(low_rank_config(hf, modules, "sltrain", record), state)


def _from_pair(splora: dict[str, Any], scalings: dict[str, float]) -> Any:
    def convert(name: str, spec: Any, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        down = parts["down.weight"]
        index, value = to_entries(parts["sparse.weight"], parts["sparse.mask"])
        out = {"lora_B": parts["up.weight"], "sparse_index": index, "sparse_value": value}
        if name in scalings:
            scaling = torch.tensor([scalings[name]], dtype=down.dtype)
            out.update(lora_A=down / scaling.tanh(), scaling=scaling)
        else:
            out["lora_A"] = down / (splora["lora_alpha"] / splora["r"])
        if "up.bias" in parts:
            out["bias"] = parts["up.bias"]
        return out

    return convert


def write(conv: Converted) -> Output:
    require_rope(conv, SLTRAIN, ROPE_THETA)
    names = layer_projections(conv.config["num_hidden_layers"])
    pairs = pairs_of(conv, SLTRAIN)
    for name in names:  # before reading their sparse parts
        require(pairs, name, SLTRAIN, None, sparse=True)
    rank = common_rank(pairs, names, SLTRAIN, "SLTrain's projections (one `r`)")
    first = pairs[names[0]]
    nnz = int(conv.state_dict[f"{names[0]}.sparse.mask"].sum())
    # Made here, lora_alpha = r: scale 1, so lora_A is the factor itself, bit for bit.
    made_splora = {"r": rank, "lora_alpha": float(rank), "lora_dropout": 0.0,
                   "sp_ratio": nnz / (first["in_features"] * first["out_features"]),
                   "target_modules": TARGETS}  # fmt: skip
    splora = layout_config(conv, SLTRAIN, "splora_config.json", made_splora)
    source = conv.config.get(SOURCE_KEY) or {}
    source = source if source.get("layout") == SLTRAIN else {}
    scalings = dict(source.get("scaling") or {})
    tensors = export_pairs(conv, SLTRAIN, _from_pair(splora, scalings), activation=None,
                           sparse=True, required=names)  # fmt: skip
    made = {**llama_fields(conv.config), "rope_theta": ROPE_THETA, "model_type": "llama",
            "architectures": ["LlamaForCausalLM"]}  # fmt: skip
    config = layout_config(conv, SLTRAIN, "config.json", made)
    if source.get("rotary_buffers"):
        tensors.update(rotary_tensors(conv.config, weights_dtype(conv.state_dict)))
    return Output({"config.json": config, "splora_config.json": splora}, tensors)
