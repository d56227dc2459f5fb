"""Layouts that keep transformers' Llama names and only replace each projection's weight by
their own factor tensors (CoLA, CoLA-M once renamed, LORO, SLTrain).

Everything outside a factored projection (embeddings, norms, head) has the name and shape
transformers' ``LlamaForCausalLM`` gives it and is copied as it is; each projection module
holding the layout's factor leaves (``cola_a``, ``weight_in``, ``lora_A``, ...) is turned
into a :class:`~boost_compiler.convert.LowRankLinear` pair by the layout's own function,
and back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import LayoutError
from .base import Converted, factor_groups, pairs_of, require

__all__ = ["export_pairs", "import_pairs", "layer_projections"]

Tensors = dict[str, torch.Tensor]
# name, the module's tensors by leaf -> (its LOW_RANK_KEY entry, the pair's tensors by leaf)
ToPair = Callable[[str, Tensors], tuple[dict[str, Any], Tensors]]
# name, its LOW_RANK_KEY entry, the pair's tensors by leaf -> the layout's tensors by leaf
FromPair = Callable[[str, Mapping[str, Any], Tensors], Tensors]


def layer_projections(n_layers: int) -> list[str]:
    """Every projection module of a Llama decoder under transformers' names."""
    from .base import PROJECTIONS

    return [f"model.layers.{i}.{p}" for i in range(n_layers) for p in PROJECTIONS]


def import_pairs(
    tensors: Tensors, leaves: Iterable[str], to_pair: ToPair
) -> tuple[Tensors, dict[str, dict[str, Any]]]:
    """The state dict under transformers' names, and the pairs' :data:`LOW_RANK_KEY` entries."""
    groups = factor_groups(tensors, leaves)
    state = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in groups}
    modules: dict[str, dict[str, Any]] = {}
    for name in sorted(groups):
        spec, pair = to_pair(name, dict(groups[name]))
        modules[name] = spec
        state.update({f"{name}.{leaf}": t for leaf, t in pair.items()})
    return state, modules


def export_pairs(
    conv: Converted,
    layout: str,
    from_pair: FromPair,
    *,
    activation: str | None,
    sparse: bool,
    required: Iterable[str] = (),
) -> Tensors:
    """The model's state dict in the layout's names: each pair through ``from_pair``
    (every pair must have ``activation`` and a sparse part iff ``sparse``; every name in
    ``required`` must be a pair), everything else as it is."""
    pairs = pairs_of(conv, layout)
    for name in required:
        require(pairs, name, layout, activation, sparse)
    grouped: dict[str, Tensors] = {name: {} for name in pairs}
    out: Tensors = {}
    for key, t in conv.state_dict.items():
        name, _, _ = key.rpartition(".")
        name, _, _ = name.rpartition(".")  # a pair's tensors are <name>.<factor>.<leaf>
        if name in grouped:
            grouped[name][key[len(name) + 1 :]] = t
        else:
            out[key] = t
    for name, parts in grouped.items():
        spec = require(pairs, name, layout, activation, sparse)
        if "down.weight" not in parts or "up.weight" not in parts:
            raise LayoutError(f"{layout}: the state dict lacks the factors of '{name}'")
        out.update({f"{name}.{leaf}": t for leaf, t in from_pair(name, spec, parts).items()})
    return out


def pop_leaf(parts: Tensors, leaf: str, name: str, layout: str) -> torch.Tensor:
    """``parts[leaf]`` removed, or a :class:`LayoutError` naming ``<name>.<leaf>``."""
    if leaf not in parts:
        raise LayoutError(f"{layout}: '{name}.{leaf}' is missing (its other tensors: "
                          f"{sorted(parts)})")  # fmt: skip
    return parts.pop(leaf)


def no_leftover(parts: Tensors, name: str, layout: str) -> None:
    """A tensor the layout's module does not have is an error, not silently dropped."""
    if parts:
        keys = ", ".join(f"'{name}.{leaf}'" for leaf in sorted(parts))
        raise LayoutError(f"{layout}: {keys}: not a tensor of the layout's projection module")
