"""Small all-reduces as symmetric-memory one-shot all-reduces (option ``symm_mem_all_reduce``).

Invariant: nothing is rewritten here. With the option at ``N`` bytes, Inductor's own rule
(``torch._inductor.comm_lowering``, switched on by ``config._collective.auto_select``)
lowers each sum all-reduce of at most ``N`` bytes whose input Inductor allocates to
``torch.ops.symm_mem.one_shot_all_reduce``: the input is allocated in the group's
symmetric memory and every rank reads every peer's buffer and adds them in rank order, so
every rank computes the same sum of the same operands: the all-reduce's value. The
others stay NCCL all-reduces. Why: BTP's collectives are the small ``[b, s, r]``
all-reduces at the narrow cut, latency-bound on a GPU, where one read of the peers' memory
replaces NCCL's ring. Off by default until measured on GPUs; CUDA tensors on an NCCL
group only (and torch's fake group, for structure checks), refused elsewhere, and refused
with a start/wait split (``collective_wait="poll"``, ``overlap_comm``): a split collective
is no longer the all-reduce Inductor's rule lowers.
"""

from __future__ import annotations

from typing import Any

from ..errors import OptionError

BACKENDS = ("nccl", "fake")


def inductor_patches(
    group_name: str, backend: str | None, max_bytes: int, wait: str, overlap: bool
) -> dict[str, Any]:
    """Inductor config patches for ``max_bytes`` (0: none) on the tensor-parallel group
    ``group_name`` whose CUDA tensors ``backend`` moves (``device.group_backend``; None:
    no backend does); enables the group's symmetric memory."""
    if max_bytes <= 0:
        return {}
    if backend not in BACKENDS:
        raise OptionError(
            f"boost option 'symm_mem_all_reduce' needs CUDA tensors on an NCCL process "
            f"group; the tensor-parallel group {group_name!r} moves CUDA tensors with "
            f"{backend!r}. Create it with backend 'nccl' (or 'cuda:nccl,cpu:gloo'), or "
            "leave the option at 0 on this group."
        )
    if wait == "poll" or overlap:
        raise OptionError(
            "boost option 'symm_mem_all_reduce' lowers torch's all-reduces, which "
            "collective_wait='poll' and overlap_comm=True split into start and wait first; "
            "use collective_wait='auto' or 'block' and overlap_comm='auto' or False with it"
        )
    if backend == "nccl":
        import warnings

        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # torch 2.13 marks it deprecated ("no longer needed"), yet the rule's
        # is_symm_mem_enabled_for_group still reads only what this call registers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(group_name)
    return {
        "_collective.auto_select": True,
        "_collective.one_shot_all_reduce_threshold_bytes": max_bytes,
    }
