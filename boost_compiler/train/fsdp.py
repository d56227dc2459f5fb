"""FSDP2 over ``dp``, as torchtitan's ``apply_fsdp`` does it: per block, then the root.

Each repeated block (the model's decoder ``layers``) is its own ``fully_shard`` unit,
so a forward all-gathers one block's parameters at a time, frees them after it (the
root keeps its own, the embedding and head, for the whole step), and FSDP2 prefetches
the next block's gather while this one computes; the gradients are reduce-scattered
block by block during the backward. Sharding per block changes no number: every
element is still the same sum over the same dp ranks.

Except where the forward never runs the blocks: a model ``parallelize`` made (tp > 1)
runs its shadow, a copy of the module tree, so hooks on the model's inner modules
would never fire (and ``parallelize`` refuses them): such a model is wrapped at its root
only, which gathers every block at once before the forward.

``--mixed-precision bf16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, torchtitan's defaults (``mixed_precision_param`` /
``mixed_precision_reduce``): the sharded parameters, which AdamW steps and whose moments
it holds, stay fp32; the all-gather casts them to bf16 for the forward and backward; the
gradients are reduced in fp32 and land fp32 on the shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..parallel.shadow import parallel_state, set_compute_dtype


def mp_policy(mixed_precision: str) -> Any:
    """The ``MixedPrecisionPolicy`` of ``--mixed-precision`` (``none``: FSDP2's default,
    everything in the parameters' dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of the outermost ``ModuleList`` / ``ModuleDict``
    (CoLA-LLaMA's and a pipeline stage's ``layers``, a transformers model's decoder list),
    not of lists nested inside a block (an MoE layer's experts)."""
    return [child for container in _outer_lists(module) for child in container.children()]


def _outer_lists(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield child
        else:
            yield from _outer_lists(child)


def shard(module: nn.Module, dp_mesh: Any, mixed_precision: str = "none") -> None:
    """``fully_shard`` each block of ``module``, then ``module`` itself, over ``dp_mesh``.

    At ``mixed_precision="bf16"`` on a parallelized module, the shadow's graphs are
    traced in bf16, the dtype FSDP2 puts on the model for each forward.
    """
    from torch.distributed.fsdp import fully_shard

    policy = mp_policy(mixed_precision)
    # The module itself, or the stage a pipeline's boundary wrapper holds.
    parallel = [m for m in module.modules() if parallel_state(m) is not None]
    if not parallel:  # the forward runs these modules: their hooks gather per block
        units = blocks(module)
        for i, block in enumerate(units):
            # torchtitan's choice: the last block's backward runs right after the forward,
            # so its gathered parameters are kept rather than gathered again.
            fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                        reshard_after_forward=i < len(units) - 1)  # fmt: skip
    fully_shard(module, mesh=dp_mesh, mp_policy=policy)
    for model in parallel if mixed_precision == "bf16" else ():
        set_compute_dtype(model, torch.bfloat16)


def dp_bytes(modules: list[nn.Module], dp: int, fsdp: bool, mixed_precision: str) -> int:
    """FSDP2's payload bytes per step over dp (0 at dp = 1; ``--no-fsdp``: one all-reduce).

    Each parameter is all-gathered for the forward, again for the backward when its unit
    reshards after the forward (every block but the last), and its gradient
    reduce-scattered; gathers move ``param_dtype``, reductions ``reduce_dtype``.
    """
    params = [p for m in modules for p in m.parameters()]
    if dp == 1:
        return 0
    stored = sum(p.numel() * p.element_size() for p in params)
    if not fsdp:
        return stored
    numel = sum(p.numel() for p in params)
    again = sum(p.numel() for m in modules for b in _resharded(m) for p in b.parameters())
    if mixed_precision == "bf16":
        return (numel + again) * 2 + numel * 4
    return stored * 2 + again * params[0].element_size()


def _resharded(module: nn.Module) -> list[nn.Module]:
    """The blocks ``shard`` made units that reshard after the forward."""
    from torch.distributed.fsdp import FSDPModule

    units = [b for b in blocks(module) if isinstance(b, FSDPModule)]
    return units[:-1]
