"""Factories for ``boost explain``: each returns ``(model, example_inputs, example_kwargs)``.

Run from the repository root::

    boost explain examples.factories:cola_llama_tiny --tp 2 --out boost-report
    boost explain examples.factories:cola_llama_40b_meta --tp 8 --out report-40b

The CoLA-LLaMA factories pass ``labels`` so the captured graph is a training
step (loss included). The GPT-2-SVD, grouped-query and CoLA reference-layout
models are the test suite's (``tests/models.py``); those factories need the
repository root on ``sys.path`` (``boost explain`` adds the working directory).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.cola_llama import build, example_inputs

Made = tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]

__all__ = [
    "cola_llama",
    "cola_llama_40b_meta",
    "cola_llama_60m",
    "cola_llama_tiny",
    "cola_ref_layout",
    "gpt2_svd",
    "gqa_cola",
]


def cola_llama(
    preset: str = "tiny", batch: int = 2, seq: int = 16, device: str | None = None, **overrides: Any
) -> Made:
    """CoLA-LLaMA preset ``preset`` (``examples.cola_llama.CONFIGS``) with token ids and labels.

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
