"""A model folder's config checked against its weight files before any model is built.

Why: transformers builds the model a config describes and compares it with the weights
only afterwards. A config whose sizes the weights do not have is then expensive before it
is wrong: with ``ignore_mismatched_sizes`` (what :func:`boost_compiler.hf_io.from_pretrained`
passes to name mismatches) ``vocab_size: 10**10`` allocates a 2.5 TB embedding and dies
with a bare "can't allocate memory"; ``num_hidden_layers: 1000000`` builds a million
layers, minutes, before reporting keys; ``num_attention_heads: 0`` is a
``ZeroDivisionError`` inside transformers' validation. Here, in increasing cost, and each
refusal naming the config key, its value and the weight file:

1. :func:`check_size_fields`: every size the config gives is a positive integer (on the
   raw ``config.json``, before transformers parses it);
2. :func:`check_against_shapes`: from the safetensors headers (shapes, not values): the
   layers the config counts are in the files, and no size exceeds the number of elements
   all the files hold together (no tensor could have such a dimension);
3. :func:`check_built_shapes`: the model the config builds on the meta device (no
   memory) has, for every weight the files hold, the files' shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from .errors import HFFolderError

__all__ = [
    "SIZE_KEYS",
    "check_against_shapes",
    "check_built_shapes",
    "check_size_fields",
    "header_shapes",
    "weight_files",
]

# Sizes and counts transformers' decoder configs give (gpt2's own names too); each must be
# a positive integer where the config gives one (null: the architecture's default).
SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "n_embd", "n_head", "n_layer", "n_inner", "n_positions", "moe_intermediate_size",
    "num_local_experts",
)  # fmt: skip
# The sizes some weight has as a dimension (or, for head counts, as a factor of one), so
# that none can exceed the elements of all the weights together. Positions are not among
# them: rotary models hold no weight of max_position_embeddings rows.
_DIMENSIONS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "n_inner", "moe_intermediate_size", "num_local_experts",
)  # fmt: skip
# A decoder layer's index in a weight name: transformers' "model.layers.3.", gpt2's "h.3.",
# Nanotron's "decoder.3.".
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|decoder)\.(\d+)\.")


def _value(config: Any, key: str) -> Any:
    """``key`` of a config dict, or of a transformers config (its ``attribute_map`` applied:
    gpt2's ``hidden_size`` is its ``n_embd``)."""
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _name(config: Any, key: str) -> str:
    """The name ``key`` has in the config file (gpt2 writes ``n_layer`` for
    ``num_hidden_layers``)."""
    alias = getattr(config, "attribute_map", {}).get(key)
    return f"{key} ({alias})" if alias else key


def check_size_fields(
    config: Mapping[str, Any], where: str, error: type[HFFolderError] = HFFolderError
) -> None:
    """Every :data:`SIZE_KEYS` entry ``config`` gives is a positive integer, else ``error``
    naming ``where`` (the file), the key and its value."""
    for key in SIZE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        # a list: one size per layer, as some architectures give intermediate_size
        values = value if isinstance(value, list) and value else [value]
        if any(type(v) is not int or v <= 0 for v in values):  # bool is an int: refused too
            raise error(
                f"{where}: '{key}' is {value!r}; a size or count of the model must be a positive "
                "integer (transformers would divide by it or build a tensor of that size)"
            )


def weight_files(folder: Path, error: type[HFFolderError] = HFFolderError) -> list[Path]:
    """The folder's ``*.safetensors``, once every shard its index names is among them.

    Why first: the checks below read the shapes of the files that are there, so a shard
    missing from an interrupted download or copy would read as "the config counts layers
    the weights lack", whose advice (fewer layers) loads a truncated model; transformers
    itself names it only with a bare ``FileNotFoundError``, after building the model.
    """
    found = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return found
    try:
        named = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise error(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from err
    missing = sorted(str(n) for n in named - {f.name for f in found})
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise error(
            f"{index}: names {len(missing)} weight file(s) that are not in the folder: {shown}. "
            "The download or copy is incomplete: fetch the missing shards"
        )
    return found


def header_shapes(
    files: Iterable[Path], error: type[HFFolderError] = HFFolderError
) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from the safetensors files' headers: no tensor is read."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as err:  # safetensors' own error type: a truncated or foreign file
            raise error(f"{file}: not a readable safetensors file ({err})") from err
    return shapes


def check_against_shapes(
    config: Any,
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    files: str,
    error: type[HFFolderError] = HFFolderError,
) -> None:
    """What the headers alone refute: more layers than the files hold, a size larger than
    all their elements together. ``config`` is a dict or a transformers config; ``where``
    names the config file, ``files`` the weight files (both go into the message)."""
    layers = _value(config, "num_hidden_layers")
    found = {int(m[1]) for key in shapes if (m := _LAYER.search(key))}
    if type(layers) is int and found and layers > max(found) + 1:
        name = _name(config, "num_hidden_layers")
        raise error(
            f"{where}: {name} is {layers:,}, but the weight files ({files}) hold layers 0 to "
            f"{max(found)} only: the model would be built with {layers - max(found) - 1:,} "
            "layer(s) that have no weights. The config is not the one these weights were "
            f"saved with: set {name} to {max(found) + 1}"
        )
    total = sum(math.prod(s) for s in shapes.values())
    for key in _DIMENSIONS:
        value = _value(config, key)
        if type(value) is int and shapes and value > total:
            raise error(
                f"{where}: {_name(config, key)} is {value:,}, more than all the weight files "
                f"({files}) hold together ({total:,} elements), so no weight of the model it "
                "describes can be read from them (and building it would allocate tensors that "
                "wide). The config is not the one these weights were saved with, or the value "
                "is a typo"
            )


def check_built_shapes(
    model: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    config: Any,
    where: str,
    files: str,
    error: type[HFFolderError] = HFFolderError,
) -> None:
    """Every weight of ``model`` (built from ``config`` on the meta device) that the files
    hold has their shape; else ``error`` naming the first keys, both shapes and the config
    keys whose values the model's shape has and the file's lacks."""
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    differ = sorted(k for k in built.keys() & shapes.keys() if built[k] != shapes[k])
    if not differ:
        return
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    parts = []
    for key in differ[:4]:
        extra = set(built[key]) - set(shapes[key])
        keys = [f"{k} {v}" for k, v in values.items() if type(v) is int and v in extra]
        why = f" ({', '.join(keys[:3])})" if keys else ""
        parts.append(f"'{key}' is {list(shapes[key])} in the files, {list(built[key])} in the "
                     f"model{why}")  # fmt: skip
    more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
    raise error(
        f"{where}: the model this config builds does not have the shapes of the weight files "
        f"({files}): {'; '.join(parts)}{more}. The config is not the one these weights were "
        "saved with: correct those sizes (nothing was allocated)"
    )
