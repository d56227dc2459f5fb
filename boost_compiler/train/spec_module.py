"""A user's own model in ``boost train``: ``--model pkg.module:function`` (or
``path/file.py:function``), the third :class:`~.model_spec.ModelSpec` kind.

The function is called with the run's :class:`~.config.TrainConfig` (its ``seq``, its
``[model]`` table as ``model_overrides``, ``data.model_vocab(cfg)`` for a tokenizer's
vocabulary) under ``torch.manual_seed(cfg.seed)`` and returns an ``nn.Module`` whose
``forward(ids, labels=ids)`` returns the loss; rank 0's values are then broadcast, so
every rank starts from one model. At ``--pp > 1`` the model must be a :class:`LayeredLM`
(an embedding, a list of layers mapping the hidden to the hidden, a head to the logits):
its stages (:class:`LayeredStage`) run exactly that chain, cut by layer, so chained they
compute the whole model's forward by construction; any other module is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import BoostError, PipelineError
from ..models.cola_llama import next_token_loss
from ..tp.shard_boundary import from_tp_shards, to_tp_shard
from .config import TrainConfig, TrainConfigError
from .model_spec import ModelSpec, same_on_every_rank
from .stages import StageSpec


class LayeredLM(nn.Module):
    """``head(layers(embed(ids)))`` with the next-token loss: a model a pipeline can cut.

    ``d_model``: the width of the hidden between layers (what crosses a stage boundary);
    ``attention``: (layers, heads x head size) for the FLOPs count, None without attention.
    """

    def __init__(
        self, embed: nn.Module, layers: Sequence[nn.Module], head: nn.Module, d_model: int,
        attention: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed, self.layers, self.head = embed, nn.ModuleList(layers), head
        self.d_model, self.attention = d_model, attention

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits if labels is None else next_token_loss(logits, labels)


class LayeredStage(nn.Module):
    """A :class:`LayeredLM` restricted to a stage's layers, under the whole model's names."""

    def __init__(self, model: LayeredLM, spec: StageSpec, boundary_group: str | None) -> None:
        super().__init__()
        self.spec, self.boundary_group = spec, boundary_group
        self.d_model, self.attention = model.d_model, model.attention
        if spec.first:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        if spec.last:
            self.head = model.head

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.spec.first:
            x = self.embed(x)
        elif self.boundary_group is not None:
            x = from_tp_shards(x, x.dim() - 1, self.boundary_group)
        for layer in self.layers.values():
            x = layer(x)
        if not self.spec.last:
            group = self.boundary_group
            return x if group is None else to_tp_shard(x, x.dim() - 1, group)
        logits = self.head(x)
        return logits if labels is None else next_token_loss(logits, labels)


class ModuleSpec(ModelSpec):
    """``--model module:function``: the model a user's function builds."""

    name = "module:function"

    def claims(self, cfg: TrainConfig) -> bool:
        return ":" in cfg.model

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, LayeredLM | LayeredStage)

    def build(self, cfg: TrainConfig) -> nn.Module:
        from ..models.factories import load_factory

        try:
            factory = load_factory(cfg.model)
        except BoostError as err:
            raise TrainConfigError(f"--model {cfg.model}: {err}") from err
        torch.manual_seed(cfg.seed)
        model = factory(cfg)
        if not isinstance(model, nn.Module):
            raise TrainConfigError(
                f"--model {cfg.model} returned a {type(model).__name__}, not an nn.Module "
                "whose forward(ids, labels=ids) returns the loss"
            )
        model.train()
        same_on_every_rank(model)
        return model

    def pipeline_dims(self, model: nn.Module) -> tuple[int, int, bool]:
        if not isinstance(model, LayeredLM):
            raise PipelineError(
                f"--pp > 1 cuts a user's model by layer, so it must be a "
                f"boost_compiler.train.LayeredLM (embed, layers, head); "
                f"{type(model).__name__} is not: return one, or train at --pp 1"
            )
        head = {id(p) for p in model.head.parameters()}
        tied = any(id(p) in head for p in model.embed.parameters())
        return len(model.layers), int(model.d_model), tied

    def stage(self, model: nn.Module, spec: StageSpec, boundary_group: str | None) -> nn.Module:
        assert isinstance(model, LayeredLM)  # pipeline_dims refused any other module
        return LayeredStage(model, spec, boundary_group)

    def attention_dims(self, model: nn.Module) -> tuple[int, int] | None:
        attention: Any = getattr(model, "attention", None)
        return None if attention is None else (int(attention[0]), int(attention[1]))
