"""Other projects' low-rank checkpoints in and out: CoLA, CoLA-M, LORO, SLTrain and the BOOST
reference's Nanotron checkpoints.

Each imports into transformers' own ``LlamaForCausalLM`` whose projections are
:class:`~boost_compiler.convert.LowRankLinear` factor pairs (and SLTrain's sparse part beside
them), recorded in ``config.json`` as :mod:`boost_compiler.hf_io` does: a model
``parallelize`` splits with no fallback, which ``boost export --format <layout>`` (or
:func:`save`) writes back in the layout's own names. Each module says which files of which
repository its mapping follows.

=================  ==========================================  ===========================
layout             recognised by                               projection ``y`` =
=================  ==========================================  ===========================
``cola``           ``config.json`` ``model_type: "cola"``      ``silu(x A) B + b``
``cola-m``         ``model_type: "cola_m"``                    same, keys split and shifted
``loro``           ``*.weight_in`` keys                        ``x W_in W_out^T + b``
``sltrain``        ``splora_config.json``, ``*.sparse_value``  ``x (B A s + S)^T + b``
``boost-nanotron`` ``*.attn.qkv_proj0.weight`` keys            ``silu(x P0^T) P1^T``
=================  ==========================================  ===========================

Nothing in a folder is executed: configs are read as JSON and weights as safetensors only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LayoutError
from ..hf_io import LOW_RANK_KEY, from_state_dict
from . import cola, loro, nanotron, sltrain
from .base import Converted, Output, Source, check_source, scan
from .files import write_output

__all__ = ["LAYOUTS", "Layout", "detect", "from_pretrained", "read", "save", "write"]


@dataclass(frozen=True)
class Layout:
    """One project's checkpoint layout: how to recognise, read and write it."""

    name: str
    source: str  # the repository files the mapping follows
    detect: Callable[[Source], bool]
    read: Callable[[Source], Converted]
    write: Callable[[Converted], Output]


# Detection order: the specific before the general (CoLA-M's keys also end in cola_a).
LAYOUTS: dict[str, Layout] = {
    "cola-m": Layout("cola-m", cola.SOURCE, cola.detect_m, cola.read_cola_m, cola.write_cola_m),
    "cola": Layout("cola", cola.SOURCE, cola.detect, cola.read_cola, cola.write_cola),
    "boost-nanotron": Layout(
        "boost-nanotron", nanotron.SOURCE, nanotron.detect, nanotron.read, nanotron.write
    ),
    "sltrain": Layout("sltrain", sltrain.SOURCE, sltrain.detect, sltrain.read, sltrain.write),
    "loro": Layout("loro", loro.SOURCE, loro.detect, loro.read, loro.write),
}


def _layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise LayoutError(f"unknown layout {name!r}; known: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[name]


def _read(path: str | Path, name: str) -> Converted:
    """The folder read in layout ``name``, once its config fits its tensors' shapes."""
    layout = _layout(name)
    source = scan(path)
    check_source(source, name, "model_config.json" if name == nanotron.NANOTRON else "config.json")
    return layout.read(source)


def refuse_auto_map(path: str | Path) -> None:
    """A ``config.json`` naming code (``auto_map``) is refused first, whatever the layout, with
    :class:`~boost_compiler.errors.RemoteCodeError`, before any other file is opened: boost
    never runs a folder's code, and says so rather than fail later on something else."""
    import json

    from ..hf_io import refuse_remote_code

    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else None
    except ValueError:
        return  # not JSON: scan() names the file
    if isinstance(config, dict) and "auto_map" in config:
        refuse_remote_code(path)


def detect(path: str | Path) -> str | None:
    """The layout a folder is in, from its configs (``model_type``, ``splora_config.json``,
    ``model_config.json``) or its tensor names; None for a Hugging Face folder boost reads
    itself (dense, or with its own ``boost_low_rank`` key)."""
    refuse_auto_map(path)
    source = scan(path, need_tensors=False)
    if LOW_RANK_KEY in source.configs.get("config.json", {}):
        return None  # boost's own export: its config says what it is
    return next((name for name, lay in LAYOUTS.items() if lay.detect(source)), None)


def read(path: str | Path, layout: str | None = None) -> Converted:
    """The folder's model as transformers config dict and state dict (see :class:`Converted`)."""
    refuse_auto_map(path)
    name = layout or detect(path)
    if name is None:
        raise LayoutError(f"{path}: not in any of the layouts {', '.join(LAYOUTS)} (give one)")
    return _read(path, name)


def from_pretrained(
    path: str | Path, *, layout: str | None = None, strict: bool = True, **kwargs: Any
) -> Any:
    """A transformers causal LM from a local folder: boost's own or a plain Hugging Face one
    (:func:`boost_compiler.hf_io.from_pretrained`), or one in another project's low-rank
    layout (``layout``: ``cola``, ``cola-m``, ``loro``, ``sltrain``, ``boost-nanotron``;
    None: detected from the folder). ``kwargs`` go to transformers (``dtype=``, ...).

    Example, a LORO folder (``*.weight_in [in, r]``, ``*.weight_out [out, r]``) and back::

        import torch
        import transformers

        import boost_compiler
        from boost_compiler.layouts import save

        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, vocab_size=256,
        )
        model = transformers.LlamaForCausalLM(config)
        boost_compiler.to_low_rank(model, method="svd", rank=16)
        save(model, "tiny-loro", "loro")
        back = boost_compiler.from_pretrained("tiny-loro")  # detected: LORO's key names
        ids = torch.tensor([[1, 2, 3]])
        print((back(ids).logits - model.eval()(ids).logits).abs().max())
    """
    from ..hf_io import from_pretrained as hf_from_pretrained

    refuse_auto_map(path)
    name = layout if layout is not None else detect(path)
    if name is None or name == "hf":
        return hf_from_pretrained(path, strict=strict, **kwargs)
    conv = _read(path, name)
    return from_state_dict(conv.config, conv.state_dict, strict=strict,
                           where=f"{path} ({name})", **kwargs)  # fmt: skip


def write(out: str | Path, layout: str, config: dict[str, Any],
          state_dict: dict[str, torch.Tensor], *, overwrite: bool = False) -> Path:  # fmt: skip
    """Write a model given as config dict and single-device state dict in ``layout``.

    ``out`` must be a new or empty folder; with ``overwrite``, the model files an earlier
    export left there (another layout's configs and tensors) are removed first, once the
    model converted, so that a read sees only this layout. A training run's folder is
    refused either way (:mod:`boost_compiler.output_folder`).
    """
    from ..output_folder import check_output_folder, prepare_output_folder

    check_output_folder(out, overwrite=overwrite, error=LayoutError)
    output = _layout(layout).write(Converted(dict(config), dict(state_dict)))
    prepare_output_folder(out, overwrite=overwrite, error=LayoutError)
    return write_output(out, output.configs, output.tensors, tree=output.tree,
                        sharded=output.sharded)  # fmt: skip


def save(model: nn.Module, out: str | Path, layout: str, *, overwrite: bool = False) -> Path:
    """Write a (single-device) transformers model with factor pairs in ``layout``
    (``out`` and ``overwrite``: as :func:`write`)."""
    import json

    from ..hf_io import layout_record
    from ..parallel.shadow import parallel_state

    if parallel_state(model) is not None:
        raise LayoutError(
            f"{type(model).__name__} is parallelized: its state dict holds this rank's shards; "
            "write(out, layout, config, boost_compiler.gather_state_dict(model)) on rank 0"
        )

    config = json.loads(model.config.to_json_string(use_diff=False))  # type: ignore[operator]
    config[LOW_RANK_KEY] = layout_record(model)  # the model's pairs as they are now
    return write(out, layout, config, model.state_dict(), overwrite=overwrite)
