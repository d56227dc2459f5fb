"""The example CoLA-LLaMA: the model and its presets ship in the package.

The code lives in :mod:`boost_compiler.models.cola_llama` (so an installed ``boost train``,
``boost explain cola-llama:<preset>`` and ``boost bench`` have it); this module re-exports it
for scripts and tests written against ``examples.cola_llama``::

    from examples.cola_llama import build, example_inputs   # same objects as below
    from boost_compiler.models.cola_llama import build, example_inputs
"""

from __future__ import annotations

from boost_compiler.models.cola_llama import *  # noqa: F403
from boost_compiler.models.cola_llama import __all__  # noqa: F401
