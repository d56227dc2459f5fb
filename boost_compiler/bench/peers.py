"""The peers' best plans: torch DTensor TP as torchtitan applies it to LLaMA, on the CoLA-LLaMA.

Used by :mod:`.harness` (``parallelize`` of ``dtensor-lowrank`` / ``dtensor-dense``), by
:mod:`.training` (compile, loss) and by :mod:`.suite` (the communication it must measure).

The configuration reproduced is torchtitan's ``apply_tp`` for LLaMA-3 (read at
``torchtitan/models/llama3/infra/parallelize.py``, commit 1c5be2897, June 2025; in
later commits the same layouts with ``use_local_output=False`` throughout, then
config-based in ``models/llama3/sharding.py``): the embedding
``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))`` (split on the
vocabulary, its output scattered along the sequence), every RMSNorm
``SequenceParallel()``, attention and FFN inputs gathered by ``PrepareModuleInput``
(``Shard(1)`` -> ``Replicate()``), q/k/v/gate/up ``ColwiseParallel``, o/down
``RowwiseParallel(output_layouts=Shard(1))`` (a reduce-scatter back to sequence shards),
the head ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
use_local_output=False)`` (vocabulary-parallel logits, a DTensor) and the cross-entropy
under ``torch.distributed.tensor.parallel.loss_parallel()`` for forward and backward
(``train.py``'s ``train_context``). Written here from those layouts, not copied.

The standard low-rank plan gets the same treatment around its factor pairs (BOOST's
"standard" TP: Megatron per pair, split along r): every ``.down`` factor
``ColwiseParallel``, every ``.up`` factor ``RowwiseParallel``. Sequence parallelism works
there too: the residual stream between blocks is ``Shard(1)`` as in the dense plan; the
block's input is gathered once per sub-block (``PrepareModuleInput``) and feeds q/k/v (or
gate/up) as one replicated DTensor, so their input gradients are summed before a single
reduce-scatter; the up factors of q/k/v/gate/up all-reduce (attention and SwiGLU need
their full outputs, all heads on every rank), and the up factors of o and down
reduce-scatter (``output_layouts=Shard(1)``) straight into the sequence-sharded residual.

Compile: as torchtitan's ``apply_compile`` (same file), each block is
``torch.compile(block, fullgraph=True)`` (Inductor); embedding, final norm, head and loss
run eagerly under DTensor (one addition: the embedding's output is cloned before the first
compiled block, :func:`compile_blocks` says why). torchtitan can also compile the loss
(``components/loss.py``): on torch 2.13 (CPU, gloo) a compiled ``next_token_loss`` under
loss_parallel, fed the logits of this model's head, returned a wrong loss (1-layer tiny
model, first step: 6.98 against 5.80 low-rank, 7.00 against 5.81 dense; the same function
on a standalone sharded DTensor was right), so the loss stays eager. The norm weights'
gradients stay ``Partial`` after backward; DTensor reduces them when fused AdamW reads
them (2L+1 all-reduces of [d] in the optimizer step, counted with the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models.cola_llama import next_token_loss

# The two DTensor systems that run torchtitan's configuration (the defaults).
TORCHTITAN = ("dtensor-lowrank", "dtensor-dense")
PROJS = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_TO_RESIDUAL = ("o_proj", "down_proj")  # the projections whose output joins the residual


def block_plan(lowrank: bool) -> dict[str, Any]:
    """One block's plan (fresh style objects per block, as parallelize_module expects)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "attn_norm": SequenceParallel(),
        # Attention.forward(x, cos, sin): only x is sharded; RoPE tables stay plain.
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    for sub, names in PROJS.items():
        for name in names:
            fqn = f"{sub}.{name}"
            to_residual = name in _TO_RESIDUAL
            if lowrank:
                plan[f"{fqn}.down"] = ColwiseParallel()
                plan[f"{fqn}.up"] = (
                    RowwiseParallel(output_layouts=Shard(1)) if to_residual else RowwiseParallel()
                )
            else:
                plan[fqn] = (
                    RowwiseParallel(output_layouts=Shard(1)) if to_residual else ColwiseParallel()
                )
    return plan


def top_plan() -> dict[str, Any]:
    """Embedding, final norm and head: vocabulary-parallel ends, sequence-parallel norm."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


def apply_tp(model: nn.Module, mesh: Any, *, lowrank: bool, world: int) -> None:
    """Shard the CoLA-LLaMA ``model`` in place with torchtitan's layouts (module docstring)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if model.cfg.tie_embeddings:  # torchtitan's plan shards embedding and head differently
        raise ValueError("the torchtitan plan needs an untied embedding and LM head")
    parallelize_module(model, mesh, top_plan())
    for block in model.layers:
        parallelize_module(block, mesh, block_plan(lowrank))
        if not lowrank:  # q/k/v are column-split by heads: the views use local counts
            attn = block.attn
            if attn.n_heads % world or attn.n_kv_heads % world:
                raise ValueError(
                    f"heads ({attn.n_heads}, {attn.n_kv_heads}) not divisible by {world}"
                )
            attn.n_heads //= world
            attn.n_kv_heads //= world
    _keep_labels_call(model)


def _keep_labels_call(model: nn.Module) -> None:
    """Keep ``model(ids, labels=ids)`` working (callers such as benchmarks/comm_per_layer.py).

    The head's output is a vocabulary-sharded DTensor, and ``ColaLlama.forward``'s own
    cross-entropy would mix it with plain labels; loss_parallel needs its context around
    the backward too, which a forward cannot provide. So this path gathers the logits
    (exact, not loss-parallel); ``boost bench`` uses :func:`compute_loss` instead.
    """
    from torch.distributed.tensor import Replicate

    logits_forward: Callable[..., Any] = model.forward

    def forward(input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = logits_forward(input_ids)
        if labels is None:
            return logits
        return next_token_loss(logits.redistribute(placements=[Replicate()]).to_local(), labels)

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first


def compile_blocks(model: nn.Module, backend: str = "inductor") -> None:
    """torchtitan's ``apply_compile``: every block ``torch.compile(fullgraph=True)``, in place."""
    # The embedding's RowwiseParallel returns an AsyncCollectiveTensor; fed straight into
    # a compiled block, its gradient came back as a plain tensor where DTensor's
    # redistribute backward wants a DTensor (AttributeError '_local_tensor', torch 2.13,
    # CPU). A clone waits for the collective and hands the block a plain tensor.
    model.embed.register_forward_hook(lambda _m, _args, out: out.clone())
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)


def loss_context(strategy: str) -> contextlib.AbstractContextManager[None]:
    """``loss_parallel()`` for the torchtitan systems (forward and backward), else nothing."""
    if strategy in TORCHTITAN:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def compute_loss(strategy: str, run: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
    """The training loss of one batch: the model's own ``labels=`` loss, or (torchtitan
    systems, inside :func:`loss_context`) the logits' cross-entropy outside the model."""
    if strategy in TORCHTITAN:
        return next_token_loss(run(ids), ids)
    return run(ids, labels=ids)


# --------------------------------------------------------------------------- communication


def predict(system: str, spec: Any, tp: int, optimizer: bool = True) -> dict[str, Any]:
    """Bytes and collectives of one step of a torchtitan-plan system (fp32; all-gather bytes
    = the gathered tensor, reduce-scatter = its input, as ``harness.count_collectives``).

    Per layer, t = b*s tokens, kv = the k/v width: dense, forward: 2 all-gathers of [t, d]
    (attention, FFN inputs) + 2 reduce-scatters of [t, d] (o, down); backward: the same
    4 swapped. Low-rank, forward: the 2 gathers, all-reduces of q (d), k, v (kv), gate,
    up (d_ff) and the reduce-scatters of o.up, down.up (d); backward: 2 reduce-scatters
    and 2 all-gathers of [t, d] and the all-reduces of the o.down (d) and down.down (d_ff)
    input gradients. Outside the layers, forward: the embedding's reduce-scatter and the
    head's all-gather of [t, d], and loss_parallel's three [b s] statistics (max, sum
    exp, target logit); backward: their two mirrors; ``optimizer``: the 2L+1 all-reduces
    of [d] of the norm weights' Partial gradients.
    """
    if tp < 2:
        raise ValueError("a tensor-parallel prediction needs tp >= 2")
    t, d, ff, L = spec.batch * spec.seq, spec.d, spec.ff, spec.layers
    kv = (spec.kv_heads or spec.heads) * d // spec.heads
    e = 4
    if system == "dtensor-dense":
        layer_fwd, layer_bwd = (4, 4 * t * d), (4, 4 * t * d)
        terms = "L x (AG+RS of [b,s,d] x 2, fwd and bwd)"
    elif system == "dtensor-lowrank":
        layer_fwd, layer_bwd = (9, t * (5 * d + 2 * kv + 2 * ff)), (6, t * (5 * d + ff))
        terms = "L x (AG, RS x 2, AR q/k/v/gate/up; bwd RS, AG x 2, AR o.down/down.down)"
    else:
        raise ValueError(f"no torchtitan plan for {system!r}")
    loss_tokens = t  # every position: the last one's label is ignored, not sliced off
    fwd_count = L * layer_fwd[0] + 2 + 3
    fwd_elems = L * layer_fwd[1] + 2 * t * d
    bwd_count = L * layer_bwd[0] + 2 + (2 * L + 1 if optimizer else 0)
    bwd_elems = L * layer_bwd[1] + 2 * t * d + ((2 * L + 1) * d if optimizer else 0)
    opt_terms = " + 2L+1 norm-grad AR [d] at AdamW" if optimizer else ""
    out: dict[str, Any] = {
        "formula": "torchtitan-" + system.removeprefix("dtensor-"),
        "fwd_bytes": fwd_elems * e + 3 * loss_tokens * 4,
        "bwd_bytes": bwd_elems * e,
        "fwd_count": fwd_count,
        "bwd_count": bwd_count,
        "terms": f"{terms} + embedding RS / head AG [b,s,d] + 3 loss stats [b,s]{opt_terms}",
    }
    out["bytes"] = out["fwd_bytes"] + out["bwd_bytes"]
    out["count"] = out["fwd_count"] + out["bwd_count"]
    return out
