"""Factories for ``boost explain``: each returns ``(model, example_inputs, example_kwargs)``.

``boost explain`` resolves its model argument here (:func:`resolve`):

- ``cola-llama:<preset>``: the packaged CoLA-LLaMA (:data:`~boost_compiler.models.cola_llama.
  CONFIGS`; ``tiny`` on the CPU, the larger presets on the meta device), with ``labels`` so
  the captured graph is a training step (loss included);
- a folder holding a Hugging Face ``config.json``: ``AutoModelForCausalLM.from_config`` on the
  meta device (the ``[hf]`` extra), optionally made low-rank first (``rank_ratio``);
- ``module:function`` / ``path/to/file.py:function``: the user's own factory.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BoostError
from .cola_llama import CONFIGS, build, example_inputs

Made = tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]

PRESET_PREFIX = "cola-llama:"

__all__ = [
    "PRESET_PREFIX",
    "cola_llama",
    "cola_llama_40b_meta",
    "cola_llama_60m",
    "cola_llama_tiny",
    "hf_config",
    "load_factory",
    "resolve",
]


def cola_llama(
    preset: str = "tiny", batch: int = 2, seq: int = 16, device: str | None = None, **overrides: Any
) -> Made:
    """CoLA-LLaMA preset ``preset`` (``CONFIGS``) with token ids and labels.

    ``device="meta"`` builds it without allocating weights (planning only).
    """
    model = build(preset, device=device, **overrides)
    (ids,) = example_inputs(model.cfg, batch=batch, seq=seq)
    if device is not None:
        ids = ids.to(device)
    return model, (ids,), {"labels": ids}


def cola_llama_tiny() -> Made:
    """d=64, 2 layers, r=16: the test suite's model."""
    return cola_llama("tiny")


def cola_llama_60m() -> Made:
    """CoLA's 60M shape (d=512, 8 layers, r=128) on the meta device."""
    return cola_llama("60m", batch=1, seq=128, device="meta")


def cola_llama_40b_meta() -> Made:
    """The 40B shape (d=8192, 48 layers, r=2048) on the meta device."""
    return cola_llama("40b", batch=1, seq=128, device="meta")


def preset(name: str) -> Made:
    """``cola-llama:<name>``: ``tiny`` on the CPU, every larger preset on the meta device."""
    if name not in CONFIGS:
        raise BoostError(f"unknown CoLA-LLaMA preset {name!r}; presets: {', '.join(CONFIGS)}")
    if name == "tiny":
        return cola_llama_tiny()
    return cola_llama(name, batch=1, seq=128, device="meta")


def hf_config(
    folder: str | Path, batch: int = 1, seq: int = 32, rank_ratio: float | None = None
) -> Made:
    """A Hugging Face causal LM from ``folder/config.json``, on the meta device (no weights read).

    With ``rank_ratio``, ``boost_compiler.to_low_rank(model, rank_ratio, method="cola")`` first:
    a dense model has no bottleneck to find. A folder holding safetensors weights has its
    config checked against their headers first (:mod:`boost_compiler.config_checks`): a
    config those weights refute explains another model than the folder's.
    """
    try:
        import transformers
    except ImportError as err:
        raise BoostError(
            f"{folder} is a Hugging Face config folder: install the [hf] extra "
            "(pip install 'boost-compiler[hf]')"
        ) from err
    from ..config_checks import (
        check_against_shapes,
        check_built_shapes,
        check_size_fields,
        header_shapes,
        weight_files,
    )
    from ..hf_io import auto_config, refuse_remote_code

    file = Path(folder) / "config.json"
    # a folder's own code never runs, whatever it asks; sizes transformers divides by
    check_size_fields(refuse_remote_code(Path(folder)), str(file))
    cfg = auto_config(Path(folder))
    weights = weight_files(Path(folder))
    shapes = header_shapes(weights)
    files = ", ".join(w.name for w in weights[:3]) + (", ..." if len(weights) > 3 else "")
    if weights:
        check_against_shapes(cfg, shapes, str(file), files)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    if weights:  # the dense model: a boost export's factor keys are not among its keys
        check_built_shapes(model, shapes, cfg, str(file), files)
    if rank_ratio is not None:
        from ..convert import to_low_rank

        to_low_rank(model, rank_ratio=rank_ratio, method="cola")
    vocab = int(getattr(cfg, "vocab_size", 256) or 256)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to("meta")
    return model, (ids,), {"labels": ids, "use_cache": False}


def load_factory(spec: str) -> Callable[[], Any]:
    """``pkg.module:function`` or ``path/to/file.py:function`` -> the function.

    A module name is imported as ``python -m`` would: from ``sys.path`` with the current
    directory first (the user's own factories live there); nothing of the package's own is
    looked for in it.
    """
    target, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise BoostError(
            f"model {spec!r} must look like 'cola-llama:<preset>', a Hugging Face config folder, "
            "'module:function' or 'file.py:function'"
        )
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise BoostError(f"factory file {target!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        cwd = str(Path.cwd())
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)  # what `python -m` and `python -c` do for the user's code
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise BoostError(f"cannot import {target!r}: {err}") from err
    if not hasattr(module, attr):
        raise BoostError(f"{target!r} has no attribute {attr!r}")
    return getattr(module, attr)


def resolve(spec: str, rank_ratio: float | None = None) -> Made:
    """``boost explain``'s model argument -> ``(model, example_inputs, example_kwargs)``."""
    if spec.startswith(PRESET_PREFIX):
        return preset(spec.removeprefix(PRESET_PREFIX))
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BoostError(f"{spec} is a folder without a Hugging Face config.json")
        return hf_config(path, rank_ratio=rank_ratio)
    made = load_factory(spec)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise BoostError("the factory must return (model, example_inputs[, example_kwargs])")
    model, inputs, *rest = made
    return model, tuple(inputs), dict(rest[0]) if rest and rest[0] else {}
