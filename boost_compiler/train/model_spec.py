"""What the trainer asks of a model family: one :class:`ModelSpec` per kind.

torchtitan's ``TrainSpec``: the trainer never tests which family it trains; it asks the
spec that :func:`.families.spec_for` picks from the run's flags to build the model, cut it
into pipeline stages, say its attention's size for the FLOPs count, give the keyword
arguments of a training call, turn its forward into one that returns the loss, and record
what an export needs. The kinds, in :mod:`.families`' list: a transformers model
(``--hf-config``/``--init-from``, :mod:`.hf_model`), a user's ``--model module:function``
(:mod:`.spec_module`), the packaged CoLA-LLaMA preset (:mod:`.spec_cola`, which claims
every other run). Invariant: no code outside a spec's module branches on the family; a
new family is one new spec added to that list.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig
from .stages import StageSpec


class ModelSpec:
    """One model family's answers; the defaults are those of a plain ``model(ids, labels=)``."""

    name = "model"
    # Whether its pipeline stages take ``attention_mask`` / ``position_ids`` (padded rows).
    pipeline_masks = False

    def claims(self, cfg: TrainConfig) -> bool:
        """Whether this spec trains the run ``cfg`` asks for."""
        raise NotImplementedError

    def owns(self, model: nn.Module) -> bool:
        """Whether ``model`` (a whole model or one of its stages) is of this family."""
        raise NotImplementedError

    def check(self, cfg: TrainConfig) -> None:
        """The family's flags' own consistency, before anything is built or written."""

    def build(self, cfg: TrainConfig) -> nn.Module:
        """The run's model, identical on every rank, in training mode, on the CPU."""
        raise NotImplementedError

    def example_kwargs(self) -> dict[str, Any]:
        """Keyword arguments every training call passes besides ``labels``."""
        return {}

    def loss_forward(self, forward: Any) -> Any:
        """``forward`` (the model or its compiled form) as ``f(ids, labels) -> loss``."""
        return forward

    def pipeline_dims(self, model: nn.Module) -> tuple[int, int, bool]:
        """(layers a pipeline splits, hidden width crossing a boundary, head tied to the
        embedding); a :class:`PipelineError` where the model cannot be split."""
        raise NotImplementedError

    def stage(self, model: nn.Module, spec: StageSpec, boundary_group: str | None) -> nn.Module:
        """``model`` restricted to ``spec``'s layers, parameters under the whole model's
        names; with ``boundary_group`` (tp > 1) the hidden enters with ``from_tp_shards``
        and leaves with ``to_tp_shard`` (``tp/shard_boundary.py``)."""
        raise NotImplementedError

    def attention_dims(self, model: nn.Module) -> tuple[int, int] | None:
        """(layers, heads x head size) of the whole model for the FLOPs count (None: no
        attention core counted)."""
        return None

    def state_record(self, model: nn.Module) -> dict[str, Any]:
        """Entries of ``train_state.json`` an export of the checkpoint needs."""
        return {}


def same_on_every_rank(model: nn.Module) -> None:
    """Rank 0's values everywhere: parallelize cuts each rank's shards from its own copy.

    An SVD's singular vectors are defined up to sign, and LAPACK may pick other signs with
    another thread count (and a user's function may draw from its own generator): shards
    cut from two models would not form one.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
