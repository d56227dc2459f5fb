"""Pipeline stages of a Hugging Face causal LM (``boost train --pp N --hf-config``).

A stage is the model itself with the other stages' parts removed: a shallow copy of the
``*ForCausalLM`` (same class, attributes, loss function, logit scaling) whose base
model keeps only this stage's decoder layers, the embedding at stage 0 only, the final
norm and the head at the last stage only, and per-layer config lists (``layer_types``)
cut to its layers. The parts are found from the model's
structure, not a per-family adapter: the decoder list is the base model's
``ModuleList`` of ``config.num_hidden_layers`` layers, the embedding and head are
``get_input_embeddings()`` / ``get_output_embeddings()``, and the final norm is the one
other child of the base model that holds parameters. Every stage runs the family's own
forward: later stages hand the received hidden state in as ``inputs_embeds``, so the
masks (causal, sliding-window per layer type, padding), position ids and rotary tables
are the family's, from the micro-batch's ``attention_mask``/``position_ids``; the last
stage's forward applies the family's head scaling and loss. Invariant: chained, the
stages compute the whole model. That holds where the base model does nothing to
``inputs_embeds`` but hand it to the first layer; families that scale or add to it there
(Granite's multiplier, GPT-2's position embeddings) would apply it at every stage, so
only families checked by ``tests/test_pipeline.py``'s chain test are accepted
(:data:`CHECKED`), the others refused by name; the same families are checked exact at
pp=2 x tp=2 (every one in the full tier, float32 at SGD lr 1e-3: at lr 0.1 Gemma 2/3,
OLMo 2 and DeepSeek-V3 amplify float32 rounding past 1e-5 within three steps, on one
device too, while in float64 every family's stages match to 1e-12). Parameter names are
the whole model's (``model.layers.3.self_attn...``, ``lm_head.weight``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import PipelineError
from ..tp.shard_boundary import from_tp_shards, to_tp_shard
from .stages import StageSpec

__all__ = ["CHECKED", "hf_dims", "hf_stage"]

# The families whose stages chain to the whole model, checked by tests/test_pipeline.py's
# chain test on every zoo family (padded rows, mixed layer types); it also checks that
# each refused family's stages do not chain, so neither list outlives its reason.
CHECKED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3",
           "olmo2", "cohere", "stablelm", "starcoder2", "gpt_neox", "mixtral", "qwen3_moe",
           "deepseek_v3")  # fmt: skip
REFUSED = {
    "granite": "its base model multiplies inputs_embeds by embedding_multiplier",
    "gpt2": "its base model adds the position embeddings to inputs_embeds",
}


@dataclass(frozen=True)
class HFParts:
    """Where a causal LM keeps what a stage splits, found from its structure."""

    base: str  # the base model's attribute on the causal LM (``base_model_prefix``)
    layers: str  # the decoder list on the base model
    embed: str  # the token embedding on the base model
    norm: str  # the final norm on the base model
    head: str  # the LM head on the causal LM
    n_layers: int
    d_model: int
    tied: bool  # the head shares the embedding's weight


def _child_named(parent: nn.Module, module: nn.Module | None, what: str) -> str:
    for name, child in parent.named_children():
        if child is module:
            return name
    raise PipelineError(f"{type(parent).__name__}: its {what} is not one of its own children")


def hf_parts(model: nn.Module, checked: bool = True) -> HFParts:
    """The parts of ``model`` a stage keeps or drops; a family outside :data:`CHECKED`
    (unless ``checked=False``: the chain test's probe of every family), or a structure
    with no single decoder list / final norm, raises :class:`PipelineError`."""
    whole: Any = model  # transformers' modules: their attributes are not typed here
    kind = whole.config.model_type
    if checked and kind not in CHECKED:
        why = REFUSED.get(kind, "its stages are not checked to chain to the whole model")
        raise PipelineError(
            f"--pp > 1 cannot split {type(model).__name__} ({kind!r}): {why}. Families split "
            f"by decoder layer: {', '.join(CHECKED)}; train this one at --pp 1"
        )
    base_name = whole.base_model_prefix
    body = getattr(whole, base_name, None)
    n = int(whole.config.num_hidden_layers)
    lists = [k for k, m in body.named_children() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(lists) != 1:
        raise PipelineError(
            f"{type(body).__name__} has {len(lists)} module lists of num_hidden_layers={n} "
            f"layers ({lists}): the decoder list must be one"
        )
    embed = _child_named(body, whole.get_input_embeddings(), "input embedding")
    head_module = whole.get_output_embeddings()
    head = _child_named(whole, head_module, "output embedding")
    others = [k for k, m in body.named_children() if k not in (lists[0], embed)
              and any(True for _ in m.parameters())]  # fmt: skip
    if len(others) != 1:
        raise PipelineError(
            f"{type(body).__name__}: besides the embedding and the layers, {others} hold "
            "parameters; a stage split needs exactly one (the final norm)"
        )
    # The config's flag and the modules can disagree (a tie made by hand); either spans
    # the first and last stage.
    tied = bool(whole.config.tie_word_embeddings) or (
        head_module.weight is whole.get_input_embeddings().weight
    )
    d = int(whole.config.hidden_size)
    return HFParts(base_name, lists[0], embed, others[0], head, n, d, tied)


def hf_dims(model: nn.Module) -> tuple[int, int, bool]:
    """(decoder layers, hidden size, whether ``lm_head`` shares the embedding's weight)."""
    parts = hf_parts(model)
    return parts.n_layers, parts.d_model, parts.tied


class _StageLayers(nn.ModuleList):
    """This stage's decoder layers under their global indices (``layers.3``), in order:
    the family's ``for layer in self.layers[:n]`` runs them as the whole model's loop."""

    def __init__(self, layers: Any = None) -> None:
        super().__init__()
        items = layers.items() if isinstance(layers, dict) else enumerate(layers or ())
        for key, layer in items:
            self.add_module(str(key), layer)

    def __getitem__(self, idx: Any) -> Any:
        layers = list(self._modules.values())
        return nn.ModuleList(layers[idx]) if isinstance(idx, slice) else layers[idx]


def _shallow(module: nn.Module) -> Any:
    """A copy of ``module`` sharing its parameters, with its own table of children."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


def hf_stage(
    model: nn.Module, spec: StageSpec, checked: bool = True, boundary_group: str | None = None
) -> nn.Module:
    """``model`` restricted to ``spec``'s share: an instance of the family's class whose
    ``forward(x, labels=None, attention_mask=None, position_ids=None)`` takes the token
    ids at stage 0, else the hidden ``[b, s, d]``, and returns the hidden, except at the
    last stage: the family's loss with ``labels``, its logits without. With
    ``boundary_group`` (the tp group's name) the hidden arrives and leaves as this tp
    rank's block of its last dim (``from_tp_shards`` / ``to_tp_shard``)."""
    parts = hf_parts(model, checked)
    whole: Any = model
    body = _shallow(getattr(whole, parts.base))
    body.config = _stage_config(body.config, spec)
    old = body._modules[parts.layers]
    body._modules[parts.layers] = _StageLayers({i: old[i] for i in spec.layers})
    if not spec.first:
        body._modules[parts.embed] = None
    if not spec.last:
        body._modules[parts.norm] = nn.Identity()
    stage = _shallow(whole)
    stage._modules[parts.base] = body
    if not spec.last:
        stage._modules[parts.head] = None
    stage.__class__ = _stage_class(type(model))
    stage.spec = spec
    stage.boundary_group = boundary_group
    return stage


def _stage_config(config: Any, spec: StageSpec) -> Any:
    """The base model's config as its loop must see it in this stage: families index
    per-layer settings by the loop's position (``config.layer_types[i]`` picks a layer's
    mask and rotary tables in Gemma 2/3 and Qwen2), so the stage's list is its layers'."""
    out = copy.copy(config)
    types = getattr(config, "layer_types", None)
    if types is not None:
        out.layer_types = [types[i] for i in spec.layers]
    return out


@functools.cache
def _stage_class(family: type) -> type:
    """The family's class with the stage's forward (one per family class)."""

    def forward(
        self: Any,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec, group = self.spec, self.boundary_group
        if not spec.first and group is not None:
            x = from_tp_shards(x, x.dim() - 1, group)
        feed = {"input_ids": x} if spec.first else {"inputs_embeds": x}
        common = {"attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": False}  # fmt: skip
        if not spec.last:
            hidden = getattr(self, self.base_model_prefix)(**feed, **common).last_hidden_state
            return hidden if group is None else to_tp_shard(hidden, hidden.dim() - 1, group)
        out = family.forward(self, **feed, **common, labels=labels)
        return out.logits if labels is None else out.loss

    return type(family.__name__ + "Stage", (family,), {"forward": forward,
                                                      "__module__": __name__})  # fmt: skip
