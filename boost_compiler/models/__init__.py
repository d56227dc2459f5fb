"""Models that ship with the package: the CoLA-LLaMA of the commands and its presets.

- :mod:`~boost_compiler.models.cola_llama`: the single-device CoLA-LLaMA (``build``,
  ``example_inputs``, presets ``tiny`` .. ``40b`` in ``CONFIGS``), trained by ``boost train``,
  benchmarked by ``boost bench``.
- :mod:`~boost_compiler.models.factories`: ``(model, example_inputs, example_kwargs)``
  factories for ``boost explain`` (``cola-llama:<preset>``, a Hugging Face config folder).
"""

from __future__ import annotations

from .cola_llama import CONFIGS, ColaLlama, ColaLlamaConfig, build, config, example_inputs

__all__ = ["CONFIGS", "ColaLlama", "ColaLlamaConfig", "build", "config", "example_inputs"]
