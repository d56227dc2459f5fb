"""Hugging Face model folders in and out of boost: :func:`from_pretrained` and :func:`write_folder`.

A boost low-rank model is an ordinary transformers model some of whose projections are
:class:`~boost_compiler.convert.LowRankLinear` factor pairs. Its folder is what
``save_pretrained`` writes (``config.json``, ``model.safetensors``,
``generation_config.json``), plus one key of ``config.json``, :data:`LOW_RANK_KEY`::

    "boost_low_rank": {
      "format": 1,
      "method": "svd",
      "modules": {
        "model.layers.0.self_attn.q_proj": {"in_features": 64, "out_features": 64,
                                            "rank": 16, "bias": false, "activation": null},
        ...
      }
    }

``method`` is how the factors were first made (``"svd"``, ``"cola"``; informational);
each module's ``activation`` (``null`` or ``"silu"``, CoLA's) is what the forward uses.
The weights are then ``<module>.down.weight [rank, in]``, ``<module>.up.weight [out,
rank]`` and ``<module>.up.bias``; a module with ``"sparse": true`` (SLTrain's, imported by
:mod:`boost_compiler.layouts`) also has ``<module>.sparse.weight [out, in]`` and its
support ``<module>.sparse.mask``.

Why a key and not a model class of our own (``auto_map`` and a modeling file):
transformers would have to execute code from the folder (``trust_remote_code``) to
build it. Here the architecture is transformers' own, picked by ``model_type``;
:func:`from_pretrained` lets transformers' ``from_pretrained`` build it from the config,
replaces the listed modules by factor pairs of the recorded shapes (no SVD, no values;
on the meta device, as transformers builds) and lets it load the safetensors weights
into them by name. Nothing in the folder is executed: the config is JSON, the weights
safetensors (``use_safetensors=True`` refuses a pickled ``.bin``),
``trust_remote_code=False``, ``local_files_only=True``, and a ``config.json`` that
would need code (``auto_map``, a ``model_type`` transformers lacks) is refused up
front by :func:`refuse_remote_code`, which ``boost explain`` uses too.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config_checks import (
    check_against_shapes,
    check_built_shapes,
    check_size_fields,
    header_shapes,
    weight_files,
)
from .convert import LowRankLinear, _conv1d_type, _dims, low_rank_layout
from .errors import BoostError, HFFolderError, RemoteCodeError

__all__ = [
    "FORMAT",
    "LOW_RANK_KEY",
    "apply_layout",
    "auto_config",
    "from_pretrained",
    "from_state_dict",
    "layout_record",
    "read_layout",
    "record_layout",
    "refuse_remote_code",
    "write_folder",
]

LOW_RANK_KEY = "boost_low_rank"
FORMAT = 1
_MODULE_FIELDS = {"in_features": int, "out_features": int, "rank": int, "bias": bool}
# What from_pretrained decides itself: loading must stay local, safetensors-only, code-free.
_FORCED = {"local_files_only": True, "use_safetensors": True, "trust_remote_code": False}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise BoostError(
            "Hugging Face models need the [hf] extra (pip install 'boost-compiler[hf]')"
        ) from err
    return transformers


def refuse_remote_code(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict, once it is clear transformers needs no code from the
    folder (or the Hub) to build it; else :class:`RemoteCodeError` naming the file and field.

    Why before transformers sees it: with ``auto_map`` (or a ``model_type`` it does not
    define) transformers imports the folder's Python files, and asks on a terminal whether
    to, so a "y" runs them. ``trust_remote_code=False`` alone would quietly build the
    built-in class under a config that says it wants another one.
    """
    tf = _transformers()
    file = Path(folder) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise HFFolderError(f"{file}: not readable as JSON ({type(err).__name__}: {err})") from err
    if not isinstance(config, dict):
        raise HFFolderError(f"{file}: must be a JSON object, not {type(config).__name__}")
    if "auto_map" in config:
        raise RemoteCodeError(
            f"{file}: 'auto_map' ({json.dumps(config['auto_map'])[:80]}) asks transformers to run "
            "Python code from the folder or the Hub, which boost never does "
            "(trust_remote_code=False); use a config of a transformers architecture (its "
            "model_type alone), without 'auto_map'"
        )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in tf.CONFIG_MAPPING:
        raise RemoteCodeError(
            f"{file}: 'model_type' {model_type!r} is not an architecture transformers "
            f"{tf.__version__} defines, so building it would need code from elsewhere, which "
            "boost never runs; use a config whose model_type transformers knows (llama, "
            "gpt2, ...)"
        )
    return config


def layout_record(model: nn.Module, method: str | None = None) -> dict[str, Any]:
    """The :data:`LOW_RANK_KEY` value describing ``model``'s factor pairs.

    ``method`` defaults to what the pairs show: ``"cola"`` when each has CoLA's SiLU,
    ``"svd"`` when none has, else ``"mixed"``.
    """
    from .convert_experts import experts_layout

    modules, experts = low_rank_layout(model), experts_layout(model)
    if method is None:
        acts = {spec["activation"] for spec in [*modules.values(), *experts.values()]}
        method = {frozenset({"silu"}): "cola", frozenset({None}): "svd"}.get(
            frozenset(acts), "mixed"
        )
    # routed experts factored per expert (to_low_rank(experts=True)) only where there are:
    # other records stay as they were
    return {"format": FORMAT, "method": method, "modules": modules,
            **({"experts": experts} if experts else {})}  # fmt: skip


def record_layout(model: nn.Module, method: str | None = None) -> dict[str, Any]:
    """Store :func:`layout_record` in ``model.config``, so that transformers'
    ``save_pretrained`` writes it into ``config.json`` and :func:`from_pretrained` can
    rebuild the factor pairs."""
    record = layout_record(model, method)
    setattr(model.config, LOW_RANK_KEY, record)
    return record


def read_layout(config: Any, where: str = "config.json") -> dict[str, Any] | None:
    """The config's :data:`LOW_RANK_KEY`, checked (None for a dense model's config)."""
    raw = (
        config.get(LOW_RANK_KEY)
        if isinstance(config, Mapping)
        else getattr(config, LOW_RANK_KEY, None)
    )
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("modules"), Mapping):
        raise HFFolderError(f"{where}: {LOW_RANK_KEY} must be an object with a 'modules' object")
    if raw.get("format") != FORMAT:
        raise HFFolderError(
            f"{where}: {LOW_RANK_KEY} format {raw.get('format')!r} is not {FORMAT}, the one this "
            "version of boost-compiler reads"
        )
    for name, spec in raw["modules"].items():
        bad = [k for k, kind in _MODULE_FIELDS.items()
               if not isinstance(spec, Mapping) or type(spec.get(k)) is not kind]  # fmt: skip
        sparse = spec.get("sparse", False) if isinstance(spec, Mapping) else False
        if (bad or spec.get("activation") not in (None, "silu") or spec["rank"] <= 0
                or type(sparse) is not bool):  # fmt: skip
            raise HFFolderError(
                f"{where}: {LOW_RANK_KEY} module '{name}' must have integer in_features, "
                f'out_features, rank > 0, boolean bias and activation null or "silu" (and '
                f"sparse, when given, a boolean); got {spec}"
            )
    _check_experts(raw.get("experts", {}), where)
    return dict(raw)


def _check_experts(experts: Any, where: str) -> None:
    ints = ("num_experts", "hidden", "intermediate")
    for name, spec in experts.items() if isinstance(experts, Mapping) else [("", None)]:
        ok = (
            isinstance(spec, Mapping)
            and all(type(spec.get(k)) is int and spec[k] > 0 for k in ints)
            and isinstance(spec.get("ranks"), list) and len(spec["ranks"]) == 2
            and all(type(r) is int and r > 0 for r in spec["ranks"])
            and spec.get("activation") in (None, "silu")
        )  # fmt: skip
        if not ok:
            raise HFFolderError(
                f"{where}: {LOW_RANK_KEY} experts '{name}' must have integer num_experts, "
                f'hidden, intermediate > 0, ranks [r1, r2] > 0 and activation null or "silu"; '
                f"got {spec}"
            )


def apply_layout(model: nn.Module, layout: Mapping[str, Any]) -> None:
    """Replace each module the layout lists by a factor pair of its shape, in place.

    Only the structure: the factors are freshly constructed (on the replaced weight's
    device, meta included) and get their values from a state dict afterwards. A module
    the model does not have, or one whose dense shape differs, raises
    :class:`HFFolderError` naming it, before anything is replaced.
    """
    modules = dict(model.named_modules())
    conv1d = _conv1d_type()
    kinds = (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)
    plan: list[tuple[str, nn.Module, Mapping[str, Any]]] = []
    for name, spec in layout["modules"].items():
        mod = modules.get(name)
        if mod is None or type(mod) not in kinds:
            what = "no such module" if mod is None else f"a {type(mod).__name__}"
            raise HFFolderError(
                f"{LOW_RANK_KEY} lists '{name}': {type(model).__name__} built from this config "
                f"has {what} there, not an nn.Linear to factor (another architecture or size?)"
            )
        _, d_in, d_out = _dims(mod, conv1d)
        if (d_in, d_out) != (spec["in_features"], spec["out_features"]):
            raise HFFolderError(
                f"{LOW_RANK_KEY} lists '{name}' as {spec['in_features']} -> "
                f"{spec['out_features']}, the model built from this config has {d_in} -> {d_out}"
            )
        plan.append((name, mod, spec))
    _apply_experts(model, layout.get("experts", {}))
    for name, mod, spec in plan:
        w = mod.weight
        pair = LowRankLinear(
            spec["in_features"], spec["out_features"], spec["rank"], bias=spec["bias"],
            activation=spec["activation"], sparse=spec.get("sparse", False), device=w.device,
            dtype=w.dtype,
        )  # fmt: skip
        pair.train(mod.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, pair)


def _apply_experts(model: nn.Module, experts: Mapping[str, Any]) -> None:
    """The layout's factored routed experts, rebuilt empty; every mismatch is named first."""
    from .convert_experts import experts_mismatch, rebuild_experts

    modules = dict(model.named_modules())
    for name, spec in experts.items():  # every check before any replacement
        wrong = experts_mismatch(modules.get(name), dict(spec))
        if wrong is not None:
            raise HFFolderError(
                f"{LOW_RANK_KEY} lists experts '{name}': {type(model).__name__} built from this "
                f"config has {wrong} there (another architecture or size?)"
            )
    for name, spec in experts.items():
        rebuild_experts(model, name, dict(spec))


def causal_lm_class(config: Any) -> type:
    """transformers' own ``*ForCausalLM`` class for the config (never a class from a folder)."""
    tf = _transformers()
    try:
        return tf.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as err:
        raise HFFolderError(
            f"model_type {getattr(config, 'model_type', None)!r} has no causal-LM class in "
            "transformers"
        ) from err


@functools.cache
def _low_rank_class(base: type) -> type:
    """``base`` whose constructor applies the config's :data:`LOW_RANK_KEY` after building.

    Why a subclass: transformers' ``from_pretrained`` constructs the model itself (on the
    meta device, in the checkpoint's dtype) and then loads the weights by name; the factor
    pairs must exist between those two steps, and the constructor is the one hook it
    offers there. Same name, module and behaviour as ``base`` otherwise (``generate()``,
    ``save_pretrained``, which writes the key again since it stays in the config).
    """

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, *args, **kwargs)
        layout = read_layout(config)
        if layout is not None:
            apply_layout(self, layout)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})  # fmt: skip


def from_pretrained(path: str | Path, *, strict: bool = True, **kwargs: Any) -> Any:
    """A transformers causal LM from a local folder, low-rank as its ``config.json`` records.

    A thin layer over transformers' own ``from_pretrained``: the architecture comes from
    the config's ``model_type`` (transformers' class, never code from the folder), the
    :data:`LOW_RANK_KEY` modules become factor pairs of the recorded shapes, and the
    safetensors weights are loaded into them. A folder without the key is an ordinary
    dense model. ``kwargs`` go to transformers (``dtype=``, ``device_map=``, ...), except
    what keeps loading safe: ``local_files_only``, ``use_safetensors`` and
    ``trust_remote_code`` are fixed. ``strict``: a weight the model lacks, one the file
    lacks, or a shape mismatch raises :class:`HFFolderError` naming them (transformers
    alone would initialise missing weights at random and only warn). Example (a folder
    ``boost export --format hf`` writes, or, as here, ``save_pretrained`` of a converted
    model whose layout was recorded)::

        import torch
        import transformers

        import boost_compiler
        from boost_compiler.hf_io import record_layout

        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, vocab_size=256,
        )
        dense = transformers.LlamaForCausalLM(config)
        boost_compiler.to_low_rank(dense, method="svd", rank_ratio=0.25)
        record_layout(dense)  # config.json's "boost_low_rank": which modules, which ranks
        dense.save_pretrained("tiny-low-rank")
        model = boost_compiler.from_pretrained("tiny-low-rank")
        print(model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5))
    """
    _transformers()  # the [hf] extra, named before anything else
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HFFolderError(f"{folder}: no config.json (not a Hugging Face model folder)")
    file = folder / "config.json"
    check_size_fields(refuse_remote_code(folder), str(file))  # before transformers divides
    clash = sorted(k for k, v in kwargs.items() if k in _FORCED and v != _FORCED[k])
    if clash:
        raise HFFolderError(f"from_pretrained fixes {', '.join(clash)}: loading runs no code "
                            "from the folder and reads only local safetensors")  # fmt: skip
    kwargs = {k: v for k, v in kwargs.items() if k not in _FORCED}
    config = kwargs.pop("config", None) or auto_config(folder)
    layout = read_layout(config, str(file))
    cls = causal_lm_class(config)
    if layout is not None:
        cls = _low_rank_class(cls)
    weights = weight_files(folder)
    if not weights:
        raise HFFolderError(f"{folder}: no .safetensors weights (pickled weights are not read)")
    shapes = header_shapes(weights)
    files = weights[0].name if len(weights) == 1 else f"{len(weights)} safetensors files"
    check_against_shapes(config, shapes, str(file), files)
    return _load(cls, str(folder), config, strict, kwargs, str(folder), shapes, files)


def auto_config(folder: Path) -> Any:
    """transformers' config of the folder (local, no code); the errors of its validation
    of the values (a head count that does not divide the width) named as ours."""
    try:
        return _transformers().AutoConfig.from_pretrained(str(folder), **_FORCED)
    except (ValueError, TypeError, ArithmeticError) as err:  # its checks of the values
        raise HFFolderError(
            f"{folder / 'config.json'}: not a configuration transformers accepts "
            f"({type(err).__name__}: {err})"
        ) from err


def _load(
    cls: type, path: str | None, config: Any, strict: bool, kwargs: dict[str, Any], where: str,
    shapes: Mapping[str, tuple[int, ...]], files: str,
) -> Any:  # fmt: skip
    """transformers' own loading (from the folder, or from ``kwargs["state_dict"]`` when
    ``path`` is None), with what it only warns about made an error under ``strict``.

    ``shapes`` (the weights' shapes, ``files`` naming where they are) are compared first with
    the model the config builds on the meta device (:mod:`boost_compiler.config_checks`):
    transformers would allocate a mismatched weight at the config's size before naming it.
    A quantized config stores packed weights of other shapes: not compared.
    """
    if strict and getattr(config, "quantization_config", None) is None:
        with torch.device("meta"):  # a copy: building sets fields (attention implementation)
            built = cls(copy.deepcopy(config))
        check_built_shapes(built, shapes, config, where, files)
        del built
    if strict:  # mismatched shapes come back in the loading info (named), not as a bare error
        kwargs.setdefault("ignore_mismatched_sizes", True)
    model, info = cls.from_pretrained(
        path, config=config, output_loading_info=True, **_FORCED, **kwargs
    )
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys",
                                                        "mismatched_keys")}  # fmt: skip
    if strict and any(problems.values()):
        detail = "; ".join(f"{k.replace('_', ' ')}: {v[:6]}" for k, v in problems.items() if v)
        raise HFFolderError(f"{where}: the weights do not fit the model its config builds: "
                            f"{detail}")  # fmt: skip
    return model


def from_state_dict(
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    where: str = "the state dict",
    **kwargs: Any,
) -> Any:
    """What :func:`from_pretrained` returns, from a config dict (``to_dict()``, with its
    :data:`LOW_RANK_KEY`) and the model's state dict in memory instead of a folder.

    The importers of other projects' layouts (:mod:`boost_compiler.layouts`) end here:
    transformers builds its own class from ``model_type`` and loads ``state_dict`` into it,
    with the same strictness (``where`` names the source in errors).
    """
    check_size_fields(config, where)
    cfg = _config_of(config, f"{where}: model_type")
    cls = causal_lm_class(cfg)
    if read_layout(cfg, where) is not None:
        cls = _low_rank_class(cls)
    clash = sorted(k for k in kwargs if k in _FORCED or k in ("config", "state_dict"))
    if clash:
        raise HFFolderError(f"from_state_dict fixes {', '.join(clash)}")
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    check_against_shapes(cfg, shapes, where, "the state dict")
    kwargs = {**kwargs, "state_dict": dict(state_dict)}
    return _load(cls, None, cfg, strict, kwargs, where, shapes, "the state dict")


def _config_of(config: Mapping[str, Any], what: str) -> Any:
    """The transformers config a config dict describes (its ``model_type``'s class); a type
    transformers does not define is an :class:`HFFolderError` starting with ``what``."""
    tf = _transformers()
    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type not in tf.CONFIG_MAPPING:
        raise HFFolderError(f"{what} {model_type!r} is not a transformers model type")
    try:
        return tf.CONFIG_MAPPING[model_type].from_dict(values)
    except (ValueError, TypeError, ArithmeticError) as err:  # its validation of the values
        raise HFFolderError(f"{what} {model_type!r}: not a configuration transformers accepts "
                            f"({type(err).__name__}: {err})") from err  # fmt: skip


def _weights_dtype(state_dict: Mapping[str, torch.Tensor]) -> torch.dtype:
    floats = [t.dtype for t in state_dict.values() if t.is_floating_point()]
    return max(set(floats), key=floats.count) if floats else torch.float32


def write_folder(
    out: str | Path,
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``config.json`` (with its :data:`LOW_RANK_KEY`), ``model.safetensors`` and
    ``generation_config.json`` to ``out``: a folder :func:`from_pretrained` loads.

    ``config`` is a transformers config as a dict (``to_dict()``), ``state_dict`` the
    model's single-device weights under its own names. Checked first, on the meta device:
    the model the config builds, with its layout applied, must have exactly these keys
    and shapes (else :class:`HFFolderError` naming the first differences), so a folder
    that could not load is never written.

    ``out`` must be a new or empty folder, or, with ``overwrite``, one whose earlier model
    files (:func:`~boost_compiler.output_folder.model_files`) are removed once the check
    passed; a training run's folder is refused either way
    (:mod:`boost_compiler.output_folder`).
    """
    from safetensors.torch import save_file

    from .output_folder import check_output_folder, prepare_output_folder

    check_output_folder(out, overwrite=overwrite)  # before the model is even built on meta
    cfg = _config_of(config, "config model_type")
    layout = read_layout(cfg, "the config")
    cfg.dtype = _weights_dtype(state_dict)
    cls = causal_lm_class(cfg)
    cfg.architectures = [cls.__name__]
    with torch.device("meta"):
        model = cls(cfg)
    if layout is not None:
        apply_layout(model, layout)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if want != got:
        shapes = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise HFFolderError(
            f"the weights do not fit {cls.__name__} built from the config: missing "
            f"{sorted(set(want) - set(got))[:6]}, unexpected {sorted(set(got) - set(want))[:6]}, "
            f"other shapes {[(k, got[k], want[k]) for k in shapes[:4]]}"
        )
    folder = prepare_output_folder(out, overwrite=overwrite)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(folder))
    # Tensors sharing storage cannot go to safetensors: tied weights are written as copies.
    tensors = {k: v.detach().contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if model.can_generate():
        _transformers().GenerationConfig.from_model_config(cfg).save_pretrained(str(folder))
    written = json.loads((folder / "config.json").read_text())
    if layout is not None and written.get(LOW_RANK_KEY) != layout:
        raise HFFolderError(f"{folder / 'config.json'}: {LOW_RANK_KEY} was not written as given")
    return folder
