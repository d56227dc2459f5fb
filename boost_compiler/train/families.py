"""The registered model families: :data:`SPECS`, asked in order, and the look-ups the
trainer makes (:func:`spec_for` from flags, :func:`spec_of` from a built model). Apart
from :mod:`.model_spec` so that a family's module imports the base class without
importing the list of families back.
"""

from __future__ import annotations

from torch import nn

from ..errors import PipelineError
from .config import TrainConfig
from .hf_model import HFSpec
from .model_spec import ModelSpec
from .spec_cola import CoLASpec
from .spec_module import ModuleSpec

# The first that claims a run trains it; the CoLA preset claims every run, so it is last.
SPECS: tuple[ModelSpec, ...] = (HFSpec(), ModuleSpec(), CoLASpec())


def spec_for(cfg: TrainConfig) -> ModelSpec:
    """The spec that trains the run ``cfg`` describes."""
    return next(s for s in SPECS if s.claims(cfg))


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec of a built model (the library's ``build_pipeline`` without flags)."""
    for spec in SPECS:
        if spec.owns(model):
            return spec
    raise PipelineError(
        f"{type(model).__name__} is of no registered model family "
        f"({', '.join(s.name for s in SPECS)}): pass its ModelSpec as model_spec="
    )
