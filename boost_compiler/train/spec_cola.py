"""The packaged CoLA-LLaMA's :class:`~.model_spec.ModelSpec`: a preset of
``boost_compiler.models.cola_llama`` (``--model tiny``), its ``[model]`` overrides, cut
into pipeline stages by block (:class:`CoLAStage`). It claims every run no other spec
claims, so the trainer's default model is the preset.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..errors import VocabSizeError
from ..models.cola_llama import next_token_loss
from ..tp.shard_boundary import from_tp_shards, to_tp_shard
from .config import TrainConfig, TrainConfigError
from .model_spec import ModelSpec
from .stages import StageSpec


class CoLAStage(nn.Module):
    """A slice of a ``ColaLlama``: its forward is the model's, restricted to the slice.

    Parameter names are the single-device model's (``layers.3.attn...``), so plans,
    checkpoints and comparisons use one vocabulary. With ``boundary_group`` (the tp
    group's name, at tp > 1) the hidden state crosses the stage's boundaries as this
    rank's block of the last dim: taken in by ``from_tp_shards``, handed on by
    ``to_tp_shard``, which the parallelized graph keeps on the residual stream's shards.
    """

    def __init__(
        self, model: nn.Module, spec: StageSpec, boundary_group: str | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.cfg = model.cfg
        self.boundary_group = boundary_group
        self.rope = copy.deepcopy(model.rope)  # every stage needs the tables
        if spec.first:
            self.embed, self.drop = model.embed, model.drop
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        if spec.last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope(x.shape[1])
        if self.spec.first:
            x = self.drop(self.embed(x))
        elif self.boundary_group is not None:
            x = from_tp_shards(x, x.dim() - 1, self.boundary_group)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if not self.spec.last:
            if self.boundary_group is not None:
                return to_tp_shard(x, x.dim() - 1, self.boundary_group)
            return x
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return next_token_loss(logits, labels)


def build_preset(cfg: TrainConfig) -> nn.Module:
    """The preset ``cfg.model`` with its overrides, seeded (identical on every rank).

    With ``--tokenizer`` the vocabulary is the tokenizer's (the preset's is replaced); a
    ``vocab_size`` override may pad it (e.g. to a multiple of tp), never cut it.
    """
    from ..models import cola_llama as cola
    from .data import model_vocab

    if cfg.model not in cola.CONFIGS:
        raise TrainConfigError(
            f"unknown --model {cfg.model!r}; presets: {sorted(cola.CONFIGS)}, or a "
            "'module:function' building your own model"
        )
    overrides = dict(cfg.model_overrides)
    overrides.setdefault("max_seq_len", max(cola.CONFIGS[cfg.model].max_seq_len, cfg.seq))
    need = model_vocab(cfg)
    if need is not None:
        given = overrides.setdefault("vocab_size", need)
        if given < need:
            raise VocabSizeError(
                f"the model's vocab_size {given} ([model] vocab_size) is smaller than the "
                f"tokenizer's {need} ({cfg.tokenizer}): drop vocab_size from the [model] table "
                f"(the trainer then sizes the model from the tokenizer) or set it >= {need}"
            )
    model = cola.build(cfg.model, seed=cfg.seed, **overrides)
    if need is None and model.cfg.vocab_size < 256:
        raise VocabSizeError(
            f"vocab_size {model.cfg.vocab_size} < 256: without --tokenizer the tokens are bytes "
            "(set vocab_size >= 256, or give --tokenizer)"
        )
    return model


class CoLASpec(ModelSpec):
    """``--model <preset>``: the packaged CoLA-LLaMA."""

    name = "cola-llama"

    def claims(self, cfg: TrainConfig) -> bool:
        return True  # the default: asked last

    def owns(self, model: nn.Module) -> bool:
        from ..models.cola_llama import ColaLlama

        return isinstance(model, ColaLlama | CoLAStage)

    def build(self, cfg: TrainConfig) -> nn.Module:
        return build_preset(cfg)

    def pipeline_dims(self, model: nn.Module) -> tuple[int, int, bool]:
        c: Any = model.cfg
        return int(c.n_layers), int(c.d_model), bool(c.tie_embeddings)

    def stage(self, model: nn.Module, spec: StageSpec, boundary_group: str | None) -> nn.Module:
        return CoLAStage(model, spec, boundary_group=boundary_group)

    def attention_dims(self, model: nn.Module) -> tuple[int, int] | None:
        # A stage keeps the whole model's cfg.
        c: Any = model.cfg
        return int(c.n_layers), int(c.n_heads) * int(c.head_dim)
