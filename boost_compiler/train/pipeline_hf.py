"""Pipeline stages of a Hugging Face ``LlamaForCausalLM`` (``boost train --pp N --hf-config``).

The counterpart of ``pipeline.CoLAStage`` for transformers' Llama (dense, or made
low-rank by ``to_low_rank``: the conversion replaces projections inside the decoder
layers and leaves the layer structure this module relies on alone). Stage 0 runs
``model.embed_tokens`` and its decoder layers, a middle stage its layers, the last its
layers, ``model.norm``, ``lm_head`` and the model's own loss function (HF's shifted
cross-entropy, ``ignore_index=-100``). Only the hidden state crosses a boundary, as for
the CoLA stages, so each stage recomputes what ``LlamaModel.forward`` hands its layers
besides it: position ids ``arange(seq)``, the rotary tables from (a copy of)
``model.model.rotary_emb``, and the causal mask from transformers' ``create_causal_mask``
with the same arguments ``LlamaModel.forward`` passes for a batch without padding and
cache (under SDPA that is ``None`` and attention runs ``is_causal``). The layers are
called with the keywords ``LlamaModel.forward`` uses, so a stage computes what the
whole model computes on the same rows.

Parameter names are the whole model's (``model.layers.3.self_attn...``,
``lm_head.weight``), so checkpoints, ``boost export --format hf`` and comparisons share
one vocabulary.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..errors import PipelineError
from .stages import StageSpec

__all__ = ["HFLlamaStage", "hf_dims", "is_hf_causal_lm"]

# Families whose ``*Model.forward`` is Llama's (embed, one causal mask for every layer,
# shared rotary tables, final norm): what the stage below reimplements. Families with
# sliding-window or per-layer masks (Mistral, Qwen2, Gemma) would need their own.
SUPPORTED = ("llama",)


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A transformers model (it carries a ``PretrainedConfig`` as ``.config``)."""
    return hasattr(getattr(model, "config", None), "model_type")


def _check(model: nn.Module) -> None:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in SUPPORTED:
        raise PipelineError(
            f"--pp > 1 splits transformers models of type {list(SUPPORTED)} by decoder layer; "
            f"{type(model).__name__} ({kind!r}) has another layer loop: train it at --pp 1"
        )
    body = getattr(model, "model", None)
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(body, part):
            raise PipelineError(f"{type(model).__name__}.model has no {part}: not Llama's layout")


def hf_dims(model: nn.Module) -> tuple[int, int, bool]:
    """(decoder layers, hidden size, whether ``lm_head`` shares the embedding's weight)."""
    _check(model)
    whole: Any = model  # transformers' modules: their attributes are not typed here
    config = whole.config
    head = getattr(whole, "lm_head", None)
    # The config's flag and the modules can disagree (a tie made by hand); either spans
    # the first and last stage.
    tied = bool(config.tie_word_embeddings) or (
        head is not None and head.weight is whole.model.embed_tokens.weight
    )
    return int(config.num_hidden_layers), int(config.hidden_size), tied


class _Body(nn.Module):
    """This stage's share of ``LlamaModel``, under its attribute names (``layers`` keeps the
    global indices as keys, so ``model.layers.3`` names the same parameters as in HF)."""

    def __init__(self, body: Any, spec: StageSpec) -> None:
        super().__init__()
        if spec.first:
            self.embed_tokens = body.embed_tokens
        self.layers = nn.ModuleDict({str(i): body.layers[i] for i in spec.layers})
        if spec.last:
            self.norm = body.norm
        # Every stage needs the tables; its buffer is non-persistent, so no state key moves.
        self.rotary_emb = copy.deepcopy(body.rotary_emb)


class HFLlamaStage(nn.Module):
    """A slice of a ``LlamaForCausalLM``; ``forward(x, labels=None)`` as ``CoLAStage``'s:
    token ids in at stage 0, else the hidden ``[b, s, d]``; the hidden out, except at the
    last stage: the loss with ``labels``, the logits without."""

    def __init__(self, model: Any, spec: StageSpec) -> None:
        super().__init__()
        _check(model)
        self.spec = spec
        self.config = model.config  # the whole model's: MFU and train_state.json read it
        self.model = _Body(model.model, spec)
        if spec.last:
            self.lm_head = model.lm_head
            # A plain function (transformers' LOSS_MAPPING entry), not a module.
            self.loss_function = model.loss_function

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        body = self.model
        hidden = body.embed_tokens(x) if self.spec.first else x
        # What LlamaModel.forward derives when given neither position ids nor a mask.
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
            position_ids=position_ids,
        )  # fmt: skip
        position_embeddings = body.rotary_emb(hidden, position_ids=position_ids)
        for layer in body.layers.values():
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=position_embeddings,
                position_ids=position_ids, cache=None, use_cache=False,
            )  # fmt: skip
        if not self.spec.last:
            return hidden
        logits = self.lm_head(body.norm(hidden))
        if labels is None:
            return logits
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
