"""Factories for ``boost explain``: each returns ``(model, example_inputs, example_kwargs)``.

The CoLA-LLaMA ones ship in the package (:mod:`boost_compiler.models.factories`,
``boost explain cola-llama:tiny``) and are re-exported here. The GPT-2-SVD, grouped-query
and CoLA reference-layout models are the test suite's (``tests/models.py``): run from the
repository root::

    boost explain cola-llama:tiny --tp 2 --out boost-report
    boost explain cola-llama:40b --tp 8 --out report-40b
    boost explain examples.factories:gpt2_svd --tp 2 --out report-gpt2
"""

from __future__ import annotations

import torch
from torch import nn

from boost_compiler.models.factories import (
    Made,
    cola_llama,
    cola_llama_40b_meta,
    cola_llama_60m,
    cola_llama_tiny,
)

__all__ = [
    "Made",
    "cola_llama",
    "cola_llama_40b_meta",
    "cola_llama_60m",
    "cola_llama_tiny",
    "cola_ref_layout",
    "gpt2_svd",
    "gqa_cola",
]


def _from_tests(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    try:
        from tests import models
    except ImportError as err:  # an installed package without the repository's tests
        raise ImportError(
            f"{name} comes from tests/models.py; run from the repository root"
        ) from err
    return getattr(models, f"make_{name}")()


def gpt2_svd() -> Made:
    """GPT-2 with SVD factors (no activation), fused q/k/v, tied LM head, LayerNorm."""
    model, inputs = _from_tests("gpt2_svd")
    return model, inputs, {}


def gqa_cola() -> Made:
    """CoLA-LLaMA with grouped-query attention (4 query heads, 2 key/value heads)."""
    model, inputs = _from_tests("gqa_cola")
    return model, inputs, {}


def cola_ref_layout() -> Made:
    """CoLA's reference-code layout: raw ``cola_a``/``cola_b`` factors used with matmul."""
    model, inputs = _from_tests("cola_ref_layout")
    return model, inputs, {}
