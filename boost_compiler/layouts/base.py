"""What every layout shares: the folder as read, the Llama model it maps onto, the checks.

Every layout here is a Llama-family decoder whose projections are low-rank; each maps onto
transformers' own ``LlamaForCausalLM`` whose projections are
:class:`~boost_compiler.convert.LowRankLinear` pairs (``down [r, in]``, ``up [out, r]``,
SiLU between them where the layout has it), recorded in ``config.json``'s
:data:`~boost_compiler.hf_io.LOW_RANK_KEY`: the structure the BTP planner parallelizes with
no fallback. A :class:`Converted` is that model as data (config dict, state dict); each
layout module reads a :class:`Source` into one and writes one back as its own files.

The layout's own config files travel in the model's config under :data:`SOURCE_KEY`, so that
an export after training writes them back as they were (only what training cannot change
is taken from there; the dimensions are always the model's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config_checks import check_against_shapes, check_size_fields
from ..errors import LayoutError
from ..hf_io import FORMAT, LOW_RANK_KEY, _weights_dtype, read_layout
from .files import read_tensors, tensor_files, tensor_shapes

__all__ = [
    "ATTN",
    "MLP",
    "PROJECTIONS",
    "SOURCE_KEY",
    "Converted",
    "Output",
    "Source",
    "check_source",
    "common_rank",
    "factor_groups",
    "llama_config",
    "llama_fields",
    "layout_config",
    "low_rank_config",
    "pair_spec",
    "pairs_of",
    "pop_rotary",
    "require",
    "require_rope",
    "rotary_tensors",
    "scan",
    "source_files",
    "take",
    "weights_dtype",
]

SOURCE_KEY = "boost_source_layout"  # config.json: {"layout": name, "files": {...}, ...}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# transformers' Llama names of the seven projections of a decoder layer.
PROJECTIONS = tuple(f"self_attn.{p}" for p in ATTN) + tuple(f"mlp.{p}" for p in MLP)
# The Llama hyper-parameters every layout's config carries under these (transformers 4.x)
# names; the rest of a layout's config is its own business (kept under SOURCE_KEY).
_LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
    "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_theta",
    "rope_scaling", "attention_bias", "attention_dropout", "mlp_bias",
)  # fmt: skip
_JSON_FILES = ("config.json", "model_config.json", "splora_config.json")


@dataclass
class Source:
    """A folder as found: its JSON config files and its tensors (read when asked)."""

    path: Path
    configs: dict[str, dict[str, Any]]
    keys: frozenset[str]
    _files: dict[str, Any] = field(repr=False)  # key -> the files holding it (files.py)
    _tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape (nanotron's shards: the merged one), from the headers."""
        return tensor_shapes(self._files)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the folder by key (nanotron's tensor-parallel shards merged)."""
        if self._tensors is None:
            self._tensors = read_tensors(self._files)
        return dict(self._tensors)


@dataclass(frozen=True)
class Converted:
    """A model as data: transformers config dict (``model_type``, :data:`LOW_RANK_KEY`,
    :data:`SOURCE_KEY`) and its single-device state dict under transformers' names."""

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Output:
    """A layout's files: JSON configs by file name, and tensors by the layout's keys
    (``tree``: one safetensors file per tensor, as Nanotron's checkpoints hold them)."""

    configs: dict[str, dict[str, Any]]
    tensors: dict[str, torch.Tensor]
    tree: bool = False
    sharded: frozenset[str] = frozenset()  # tree keys written as tensor-parallel tensors


def scan(path: str | Path, *, need_tensors: bool = True) -> Source:
    """The folder's JSON configs and tensor keys, without reading any tensor (a folder
    without safetensors weights is an error, unless ``need_tensors`` is false)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LayoutError(f"{folder}: not a folder")
    configs = {}
    for name in _JSON_FILES:
        file = folder / name
        if file.is_file():
            try:
                configs[name] = json.loads(file.read_text())
            except ValueError as err:
                raise LayoutError(f"{file}: not JSON ({err})") from err
            if not isinstance(configs[name], dict):
                raise LayoutError(f"{file}: must be a JSON object")
    try:
        files = tensor_files(folder)
    except LayoutError:
        if need_tensors:
            raise
        files = {}
    return Source(folder, configs, frozenset(files), files)


def check_source(source: Source, layout: str, config_file: str) -> None:
    """The layout's config file against the folder's tensors, before any is read
    (:mod:`boost_compiler.config_checks`: sizes positive integers, the layers counted there,
    no size beyond all the tensors' elements): a layout's reader sizes buffers from the
    config (RoPE frequencies of ``hidden_size / num_attention_heads``)."""
    config = source.configs.get(config_file)
    if config is None:
        return  # the layout's reader names the missing file
    where = f"{source.path / config_file} ({layout})"
    check_size_fields(config, where, LayoutError)
    check_against_shapes(config, source.shapes(), where, f"the safetensors under {source.path}",
                         LayoutError)  # fmt: skip


def llama_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The Llama hyper-parameters of a transformers config dict under their 4.x names
    (``rope_theta``, ``rope_scaling``), which the other projects' configs use."""
    out = {k: config[k] for k in _LLAMA_FIELDS if k in config}
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping):  # transformers 5 keeps rope_theta in rope_parameters
        out["rope_theta"] = rope.get("rope_theta", out.get("rope_theta"))
        extra = {k: v for k, v in rope.items() if k != "rope_theta"}
        if extra.get("rope_type", "default") != "default":
            out["rope_scaling"] = extra
    return out


def llama_config(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """transformers' ``LlamaConfig`` of these hyper-parameters, as a dict (validated and
    normalised by transformers itself: its defaults for what ``values`` lacks)."""
    import transformers as tf

    fields = {k: v for k, v in values.items() if k in _LLAMA_FIELDS and v is not None}
    check_size_fields(fields, where, LayoutError)  # transformers divides by some of them
    try:
        config = tf.LlamaConfig(**fields)
    except (TypeError, ValueError) as err:
        raise LayoutError(
            f"{where}: not a Llama configuration transformers accepts: {err}"
        ) from err
    out = config.to_dict()
    out["architectures"] = ["LlamaForCausalLM"]
    return out


def pair_spec(
    d_in: int, d_out: int, rank: int, *, bias: bool, activation: str | None, sparse: bool = False
) -> dict[str, Any]:
    """One module's entry of :data:`LOW_RANK_KEY` (what ``apply_layout`` builds)."""
    spec = {"in_features": d_in, "out_features": d_out, "rank": rank, "bias": bias,
            "activation": activation}  # fmt: skip
    return {**spec, "sparse": True} if sparse else spec


def low_rank_config(
    config: Mapping[str, Any],
    modules: Mapping[str, Mapping[str, Any]],
    method: str,
    source: Mapping[str, Any],
) -> dict[str, Any]:
    """``config`` with the factor pairs and the layout's own files recorded."""
    record = {"format": FORMAT, "method": method, "modules": dict(modules)}
    return {**config, LOW_RANK_KEY: record, SOURCE_KEY: dict(source)}


def take(tensors: dict[str, torch.Tensor], key: str, layout: str, shape: Iterable[int] | None = None
         ) -> torch.Tensor:  # fmt: skip
    """Remove and return ``tensors[key]``; a missing key or another shape is a
    :class:`LayoutError` naming the key and the layout."""
    if key not in tensors:
        raise LayoutError(f"{layout}: the folder has no '{key}', which its layout requires")
    t = tensors.pop(key)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise LayoutError(
            f"{layout}: '{key}' has shape {tuple(t.shape)}, the layout needs {tuple(shape)}"
        )
    return t


def factor_groups(
    tensors: Mapping[str, torch.Tensor], factors: Iterable[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """The modules holding any of ``factors`` (leaf names such as ``cola_a``): module name
    -> every tensor under it by leaf name (its bias too)."""
    leaves = set(factors)
    modules = {k.rpartition(".")[0] for k in tensors if k.rpartition(".")[2] in leaves}
    groups: dict[str, dict[str, torch.Tensor]] = {m: {} for m in modules}
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in groups:
            groups[module][leaf] = t
    return groups


def pairs_of(conv: Converted, layout: str) -> dict[str, dict[str, Any]]:
    """The model's factor pairs (its :data:`LOW_RANK_KEY` modules), which an exporter
    writes in its layout's names; a model without them has nothing to write."""
    record = read_layout(conv.config, "the model's config")
    if record is None or not record["modules"]:
        raise LayoutError(
            f"{layout}: the model has no low-rank projections ({LOW_RANK_KEY} is absent): "
            "convert it first (to_low_rank, or boost train's --hf-config / --init-from)"
        )
    return dict(record["modules"])


def source_files(conv: Converted, layout: str) -> dict[str, dict[str, Any]]:
    """The layout's own config files as they were read, when the model came from it."""
    source = conv.config.get(SOURCE_KEY) or {}
    return dict(source.get("files", {})) if source.get("layout") == layout else {}


_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "rank", "r", "attn_rank", "mlp_rank")  # fmt: skip


def layout_config(conv: Converted, layout: str, file: str, made: dict[str, Any]) -> dict[str, Any]:
    """The layout's config ``file`` to write: as it was read when the model came from this
    layout (its fields beyond the model's are the project's own business), else ``made``
    (what the model's config gives). A read file whose dimensions no longer fit the model
    is an error, not a file that describes another model."""
    kept = source_files(conv, layout).get(file)
    if kept is None:
        return made
    differ = [k for k in _DIMS if k in kept and k in made and kept[k] != made[k]]
    if differ:
        raise LayoutError(f"{layout}: the {file} this model was read from says "
                          f"{ {k: kept[k] for k in differ} }, the model has "
                          f"{ {k: made[k] for k in differ} }")  # fmt: skip
    return dict(kept)


def require(
    pairs: Mapping[str, Mapping[str, Any]], name: str, layout: str, activation: str | None,
    sparse: bool | None = False,
) -> Mapping[str, Any]:  # fmt: skip
    """The pair named ``name``, or a :class:`LayoutError` saying why ``layout`` cannot hold
    that projection (dense, another activation, a sparse part it has no key for)."""
    spec = pairs.get(name)
    if spec is None:
        raise LayoutError(f"{layout}: '{name}' is dense in this model; the layout stores every "
                          "projection as low-rank factors")  # fmt: skip
    if spec["activation"] != activation:
        raise LayoutError(
            f"{layout}: '{name}' has activation {spec['activation']!r} between its factors; "
            f"the layout's forward has {activation!r}"
        )
    if sparse is not None and bool(spec.get("sparse", False)) != sparse:
        want = "needs a sparse part" if sparse else "has no key for a sparse part"
        raise LayoutError(f"{layout}: '{name}' {'lacks' if sparse else 'has'} a sparse part; "
                          f"the layout {want}")  # fmt: skip
    return spec


def require_rope(conv: Converted, layout: str, theta: float) -> None:
    """A layout whose Llama code fixes RoPE (base ``theta``, no scaling, whatever its config
    says) cannot hold a model with other frequencies: writing ``theta`` into the config
    would describe another model, so it is a :class:`LayoutError` naming both."""
    fields = llama_fields(conv.config)
    got, scaling = fields.get("rope_theta", 10000.0), fields.get("rope_scaling")
    if got is None:  # written null: transformers' default or another value, unknown here
        raise LayoutError(f"{layout}: the model's config has rope_theta null; write its RoPE "
                          f"base into config.json (the layout's Llama computes base {theta})")  # fmt: skip
    if float(got) != theta or scaling:
        raise LayoutError(f"{layout}: the model's RoPE is rope_theta {got}"
                          f"{f', rope_scaling {scaling}' if scaling else ''}; the layout's Llama "
                          f"computes base {theta} with no scaling whatever its config says")  # fmt: skip


def common_rank(pairs: Mapping[str, Mapping[str, Any]], names: Iterable[str], layout: str,
                what: str) -> int:  # fmt: skip
    """The one rank ``names`` share (a layout with one ``rank`` field cannot hold two)."""
    ranks = {pairs[n]["rank"] for n in names if n in pairs}
    if len(ranks) != 1:
        raise LayoutError(f"{layout}: {what} must share one rank, the model has {sorted(ranks)}")
    return ranks.pop()


_ROTARY = "rotary_emb.inv_freq"


def _inv_freq(config: Mapping[str, Any]) -> torch.Tensor:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = llama_fields(config).get("rope_theta", 10000.0)
    # The expression of the Llama copies these projects train with (their modeling_llama.py).
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def pop_rotary(tensors: dict[str, torch.Tensor], config: Mapping[str, Any], layout: str) -> bool:
    """Remove the per-layer ``rotary_emb.inv_freq`` buffers older Llama code saved with the
    weights (transformers recomputes them), after checking they are the frequencies
    ``config`` gives (else the folder's RoPE is another one: an error, not a silent change).
    Returns whether there were any, so that an export writes them back.

    The check is at the precision the buffer was saved in: a model cast to bf16 before
    saving (``model.to(torch.bfloat16)`` casts buffers too) rounds each frequency to 8
    bits of mantissa, which is the same RoPE, not another one.
    """
    found = [k for k in tensors if k.endswith("." + _ROTARY)]
    want = _inv_freq(config)
    for key in found:
        got = tensors.pop(key)
        # float32 keeps the former 1e-6 (a few ulps: another expression of the same values)
        rtol = max(1e-6, torch.finfo(got.dtype).eps) if got.is_floating_point() else 0.0
        if (got.shape != want.shape or not got.is_floating_point()
                or not torch.allclose(got.float(), want, rtol=rtol, atol=0)):  # fmt: skip
            raise LayoutError(f"{layout}: '{key}' ({got.dtype}, shape {tuple(got.shape)}) holds "
                              f"other RoPE frequencies than rope_theta "
                              f"{llama_fields(config).get('rope_theta')} and head_dim "
                              f"{want.numel() * 2} give, even at {got.dtype}'s precision "
                              f"(relative tolerance {rtol:.1e})")  # fmt: skip
    return bool(found)


def rotary_tensors(
    config: Mapping[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The ``rotary_emb.inv_freq`` buffers :func:`pop_rotary` removed, one per layer, in
    ``dtype`` (the weights': those projects' code casts buffers with the model)."""
    want = _inv_freq(config).to(dtype)
    return {f"model.layers.{i}.self_attn.{_ROTARY}": want.clone()
            for i in range(config["num_hidden_layers"])}  # fmt: skip


def weights_dtype(state_dict: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype most of the state dict's tensors have (float32 if none is)."""
    return _weights_dtype(state_dict)
