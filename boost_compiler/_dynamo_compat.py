"""Dynamo settings boost traces with, on every torch release it supports (2.13-2.15).

:func:`tracing_patches` is merged into the ``torch._dynamo.config.patch(...)`` around
each trace that boost starts itself: ``parallelize``'s capture (:mod:`.ir.capture`)
and the parallelized model's forward (:class:`.parallel.shadow.ShadowForward`, which covers
its own eager compile, the user's ``torch.compile(model, backend="boost")`` of it, and
its ``compile_blocks`` regions, all traced inside that frame). Scoped, so models that
boost never touches keep dynamo's defaults.

``skip_fwd_side_effects_in_bwd_under_checkpoint``: a forward under
``torch.utils.checkpoint`` (HF's ``gradient_checkpointing_enable()``) may not have
Python side effects by dynamo's default, since eager checkpointing would repeat them
when it recomputes the forward in the backward and a compiled graph cannot. The
``kernels`` package (installed with transformers 5.25, optional with 5.24) wraps
attention and MLP forwards in ``use_kernelized_func``, which sets a global
(a ``CompileableContextVar``) inside every call: dynamo refuses the whole region
("Unsupported HOP: Unsafe side effect ..."), with or without boost. The flag applies
such side effects once, in the forward, and skips them in the recompute; the
wrapper's switch is restored by the same call, so nothing is lost.
tests/test_regions.py (``kernels`` installed) fails without it.
"""

from __future__ import annotations

from typing import Any

import torch._dynamo.config as _config

# Each name is checked against the installed torch: a setting a release lacks is left out
# rather than failing dynamo's patch (all of these exist in torch 2.13, 2.14 and 2.15).
_WANTED: dict[str, Any] = {
    "skip_fwd_side_effects_in_bwd_under_checkpoint": True,
}


def tracing_patches() -> dict[str, Any]:
    """The ``torch._dynamo.config`` values boost sets while it traces a model."""
    return {k: v for k, v in _WANTED.items() if hasattr(_config, k)}
