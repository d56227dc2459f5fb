"""Single-device checkpoints of a parallelized model, and back.

Why: after ``parallelize`` every rank holds only its shards, under the original
parameter names but with local shapes, so ``model.state_dict()`` is a per-rank
fragment that no single-device model can load. :func:`gather_state_dict` all-gathers
each sharded parameter along the dim it was split on (the placement ``parallelize``
recorded in ``model.boost_plan``; a *blocked* shard, e.g. a fused q/k/v factor whose
ranks each hold a slice of every block, is put back in global order) and returns
exactly what the unparallelized model's ``state_dict()`` would: same names, global
shapes, loadable with ``strict=True``.
:func:`load_state_dict` is the inverse: every rank keeps its block of each tensor.

Both copy values, never replace parameter objects: the optimizer and the compiled
shadow forward keep pointing at the same local shards.

Files: the result holds plain, distinct, contiguous tensors (tied parameters are
cloned per name), so ``safetensors.torch.save_file`` takes it as is, and
``torch.save`` files load back with ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import StateDictError
from ..tp.collectives import _raw_all_gather
from ..tp.placement import Placement, R
from .shadow import parallel_state

log = logging.getLogger("boost_compiler.parallel.state_dict")

__all__ = ["StateDictError", "gather_state_dict", "load_state_dict", "reset_parameters"]


def _layout(model: nn.Module) -> tuple[Any, dict[str, tuple[torch.Tensor, Placement, tuple]]]:
    """Per state-dict key: the local tensor, its placement and its global shape.

    ``plan.params`` is keyed by each parameter's first name in module order (tied
    parameters appear once), so every alias is resolved through the tensor's identity.
    Buffers are never sharded by ``parallelize``: they are replicated, full-size.
    """
    state = parallel_state(model)
    if state is None:
        raise StateDictError(
            f"{type(model).__name__} was not parallelized "
            "(use model.state_dict() / model.load_state_dict() directly)"
        )
    plan = state.plan
    first: dict[int, str] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(prm), name)
    out: dict[str, tuple[torch.Tensor, Placement, tuple]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        fqn = first.get(id(t))
        if fqn is None:  # a buffer
            out[key] = (t, R, tuple(t.shape))
            continue
        placement = plan.params.get(fqn, R)
        shape = tuple(plan.param_shapes.get(fqn, tuple(t.shape)))
        out[key] = (t, placement, shape)
    return plan, out


def _group_of(plan: Any) -> tuple[str, int, int]:
    group = plan.group
    pg = dist.distributed_c10d._resolve_process_group(group)
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if size != plan.p:
        raise StateDictError(
            f"process group {group!r} has {size} ranks, the model was parallelized over {plan.p}"
        )
    return group, size, rank


def _gather_one(
    key: str, local: torch.Tensor, placement: Placement, shape: tuple, group: str, size: int
) -> torch.Tensor:
    if placement.is_shard:
        full = _raw_all_gather(local.detach(), placement.dim, group, size)
        if placement.blocks:  # [r0: b0/p b1/p .., r1: ..] -> [b0, b1, ..]
            full = placement.unshard(full.chunk(size, placement.dim))
    elif placement.kind == "R":
        full = local.detach()
    else:
        raise StateDictError(f"'{key}' has placement {placement}: only R and S(d) can be gathered")
    if tuple(full.shape) != shape:
        raise StateDictError(f"'{key}': gathered shape {tuple(full.shape)} != recorded {shape}")
    return full


def gather_state_dict(
    parallel_model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """The full, single-device ``state_dict`` of a model that ``parallelize`` sharded.

    A collective: every rank of the tensor-parallel group must call it. With
    ``rank0_only`` the ranks other than the group's rank 0 get ``{}`` (they still take
    part in the all-gathers, holding at most one gathered tensor at a time);
    ``cpu_offload`` moves each gathered tensor to CPU as it arrives, so GPU memory never
    holds the whole model. Example (under ``torchrun --nproc-per-node 2``)::

        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        import boost_compiler
        from boost_compiler.models.cola_llama import build, example_inputs

        dist.init_process_group("gloo")
        model, whole = build("tiny"), build("tiny")  # one seed: the same weights
        (ids,) = example_inputs(model.cfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        boost_compiler.parallelize(model, mesh, (ids,))
        sd = boost_compiler.gather_state_dict(model, rank0_only=True)
        if dist.get_rank() == 0:  # the single-device model's names and shapes
            whole.load_state_dict(sd, strict=True)
            torch.save(sd, "model.pt")
    """
    plan, layout = _layout(parallel_model)
    group, size, rank = _group_of(plan)
    keep = not rank0_only or rank == 0
    uses: dict[int, int] = {}
    for local, _, _ in layout.values():
        uses[id(local)] = uses.get(id(local), 0) + 1
    tied: dict[int, torch.Tensor] = {}  # gathered once, for parameters under several names
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, (local, placement, shape) in layout.items():
            full = tied.get(id(local))
            fresh = full is None
            if full is None:
                full = _gather_one(key, local, placement, shape, group, size)
                if uses[id(local)] > 1:
                    tied[id(local)] = full
            if keep:
                # Own storage per key: never alias a live (replicated) parameter, nor
                # another key of the result (safetensors refuses shared storage).
                if cpu_offload and full.device.type != "cpu":
                    full = full.cpu()
                elif not placement.is_shard or not fresh:
                    full = full.clone()
                out[key] = full
    log.info(
        "gathered %d tensor(s) of %s over tp=%d%s",
        len(layout),
        type(parallel_model).__name__,
        size,
        " (rank 0 keeps them)" if rank0_only else "",
    )
    return out


def load_state_dict(
    parallel_model: nn.Module, full_state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> Any:
    """Load a single-device ``state_dict`` into a parallelized model: each rank its block.

    The same on every rank (no communication): a sharded parameter takes block
    ``rank`` of ``p`` along its placement's dim, a replicated one the whole tensor.
    Shapes are checked against the *global* shapes first, so a wrong checkpoint raises
    :class:`StateDictError` naming the key before anything is copied. Returns what
    ``nn.Module.load_state_dict`` returns (missing and unexpected keys, when not strict).
    """
    plan, layout = _layout(parallel_model)
    _, size, rank = _group_of(plan)
    missing = [k for k in layout if k not in full_state_dict]
    unexpected = [k for k in full_state_dict if k not in layout]
    if strict and (missing or unexpected):
        raise StateDictError(
            f"state dict does not match {type(parallel_model).__name__}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    local_sd: dict[str, torch.Tensor] = {}
    for key, (_, placement, shape) in layout.items():
        if key not in full_state_dict:
            continue
        full = full_state_dict[key]
        if tuple(full.shape) != shape:
            raise StateDictError(
                f"'{key}': checkpoint shape {tuple(full.shape)} != model's global shape {shape}"
            )
        if placement.is_shard:  # this rank's block (of every logical block, if blocked)
            full = placement.shard(full, rank, size)
        elif placement.kind != "R":
            raise StateDictError(f"'{key}' has placement {placement}: cannot load it")
        local_sd[key] = full
    for key in unexpected:
        local_sd[key] = full_state_dict[key]
    # nn.Module.load_state_dict copies in place under no_grad: parameter identity, which
    # the optimizer and the shadow forward rely on, is kept.
    return parallel_model.load_state_dict(local_sd, strict=strict)


def reset_parameters(parallel_model: nn.Module) -> int:
    """Initialise a parallelized model exactly as its single-device version would be.

    Each module's own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``,
    norms...) runs, in ``model.modules()`` order, on full-shape tensors, and every
    rank keeps its block: so the fan-in an init reads is the global one (on a
    shard it would be ``d/p`` and the weights ``sqrt(p)`` times too large), and
    with the same seed on every rank (``parallelize`` synchronises the ranks'
    generators) the values equal a single-device ``reset_parameters`` in the same
    order. One module's full parameters exist at a time. The way to initialise a
    model parallelized on the meta device::

        model.to_empty(device="cpu")          # each rank: its shards, uninitialised
        torch.manual_seed(0)                  # the same seed on every rank
        boost_compiler.reset_parameters(model)

    Returns how many modules were reset. A module without ``reset_parameters``
    keeps what it has; load a full state dict for those (:func:`load_state_dict`).
    """
    plan, layout = _layout(parallel_model)
    _, size, rank = _group_of(plan)
    by_tensor = {id(t): (placement, shape) for t, placement, shape in layout.values()}
    count = 0
    for mod in parallel_model.modules():
        if not callable(getattr(mod, "reset_parameters", None)):
            continue
        own = {n: p for n, p in mod._parameters.items() if p is not None and id(p) in by_tensor}
        full = {
            n: nn.Parameter(torch.empty(by_tensor[id(p)][1], dtype=p.dtype, device=p.device))
            for n, p in own.items()
        }
        mod._parameters.update(full)
        try:
            mod.reset_parameters()
        finally:
            mod._parameters.update(own)
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(by_tensor[id(p)][0].shard(full[n].detach(), rank, size))
        count += 1
    return count
