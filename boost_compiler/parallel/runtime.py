"""The backend's tensor-parallel runtime: a parallelized model's graph runs on the local shards.

Invariant: the graph the passes rewrote computes on this rank's shards, never on the
global-shape placeholders dynamo traced with: each is swapped for its owner's current shard
at every call (looked up then, never bound at compile time), and a graph compiled for one
group refuses another group's parameters by name. Registered with the backend on import
(:func:`boost_compiler.backend.register_parallel_compile`), because this layer sits above the
backend: ``parallelize`` compiles its shadow through ``boost_backend``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..backend import _lower_with_inductor, register_parallel_compile
from ..errors import ShardingError
from ..ir.placeholder import current_local, placeholder_record
from ..lowering import polls, symm_mem
from ..options import BoostOptions
from ..passes import BoostPass


def compile_parallel(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    shards: dict[int, Any],
    tp: Any,
    ran: Sequence[BoostPass],
    opts: BoostOptions,
    mode: str | None,
) -> Callable[..., Any]:
    """Lower ``gm`` (rewritten by the passes) and run it on the real local shards.

    ``shards`` maps the positions of the placeholders among ``example_inputs`` to them;
    ``tp`` is their group.
    """
    local_inputs = _local_example_inputs(example_inputs, shards)
    opts = _resolve_overlap(opts, tp, local_inputs[min(shards)].device)
    if opts.settings["lowering"] == "eager":
        fn: Callable[..., Any] = gm.forward
    elif opts.settings["compile_in_turns"]:
        fn = _in_turns(
            tp,
            lambda: _lower_with_inductor(
                gm, local_inputs, ran, opts, mode, _symm_mem_patches(tp, opts)
            ),
        )
    else:
        fn = _lower_with_inductor(gm, local_inputs, ran, opts, mode, _symm_mem_patches(tp, opts))
    return _with_local_shards(fn, sorted(shards), tp)


def _in_turns(tp: Any, compile_: Callable[[], Any]) -> Any:
    """Compile on one rank of the group after another (option ``compile_in_turns``).

    The ranks' graphs differ only in a few rank offsets, so most generated
    kernels are identical: with a shared Inductor cache directory, rank i>0
    finds them compiled by rank 0 instead of compiling them again on the same
    cores at the same time. The backward graph is compiled now too (not lazily
    at the first backward), inside this rank's turn. Turns are taken with
    barriers on the group's own process group, outside any traced code; every
    rank compiles the same graphs in the same order (SPMD), so they match.

    A compile that raises still takes part in every barrier, and raises after
    them: dynamo restarts a frame's analysis by raising from inside the backend
    (with ``dynamic=True``, its scalar-tensorify pass does), and a rank leaving
    the turns early would pair its next barrier with another rank's collective.
    """
    pg = torch.distributed.distributed_c10d._resolve_process_group(tp.name)
    fn, error = None, None
    for turn in range(tp.size):
        if turn == tp.rank:
            try:
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    fn = compile_()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the turns
                error = exc
        torch.distributed.barrier(group=pg)
    if error is not None:
        raise error
    return fn


def _local_example_inputs(example_inputs: Sequence[Any], shards: dict[int, Any]) -> list[Any]:
    """The example inputs with each global placeholder replaced by this rank's shard.

    The shards go in as static fake tensors of dynamo's fake mode. Dynamo
    fakified the global placeholders (static: parameters), never the shards;
    AOTAutograd would fakify a real shard itself and, under ``dynamic=True``,
    give its sizes fresh symbols duck-sized onto equal activation sizes (a
    16-row weight and a 16-token sequence share one symbol). No guard covers
    that, and the next sequence length breaks the compiled graph.
    """
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    out = list(example_inputs)
    for i, x in shards.items():
        local = current_local(x)
        out[i] = local if fake_mode is None else fake_mode.from_tensor(local, static_shapes=True)
    return out


def _with_local_shards(fn: Callable[..., Any], positions: list[int], tp: Any) -> Callable[..., Any]:
    """Call ``fn`` with each placeholder argument replaced by its local shard, per call.

    The shard is looked up on the argument at run time, never bound at compile
    time: dynamo lifts parameters to graph inputs without guarding on their
    identity, so two parallelized instances of one model class share this
    compiled graph, and each must run on its own shards.
    """

    def run(*args: Any) -> Any:
        args_ = list(args)
        for i in positions:
            record = placeholder_record(args_[i])
            if record.group != tp:
                raise ShardingError(
                    f"a graph compiled for tensor-parallel group {tp} was called with "
                    f"parameter {record.fqn!r} of group {record.group}; "
                    "compile each differently parallelized model separately"
                )
            args_[i] = current_local(args_[i])
        return fn(*args_)  # dynamo calls a backend's result positionally

    return run


def _resolve_overlap(opts: BoostOptions, tp: Any, device: torch.device) -> BoostOptions:
    """``overlap_comm="auto"`` made ``True`` where the group's collectives of ``device``'s
    tensors are polled (``lowering.polls``: gloo, unless ``collective_wait`` says otherwise),
    ``False`` elsewhere: on NCCL a collective is a stream dependency, not a sleeping core,
    and Inductor's peak-memory re-ordering, which the overlap turns off, stays on."""
    if opts.settings["overlap_comm"] != "auto":
        return opts
    on = polls(tp.name, opts.settings["collective_wait"], device)
    return dataclasses.replace(opts, settings={**opts.settings, "overlap_comm": on})


def _symm_mem_patches(tp: Any, opts: BoostOptions) -> dict[str, Any]:
    """Option ``symm_mem_all_reduce`` on the group ``tp`` (``lowering/symm_mem.py``)."""
    if not opts.settings["symm_mem_all_reduce"]:
        return {}
    import torch.distributed as dist

    from ..device import group_backend

    pg = dist.distributed_c10d._resolve_process_group(tp.name)
    # symmetric memory is CUDA memory: what counts is the backend of the CUDA tensors
    return symm_mem.inductor_patches(
        tp.name, group_backend(pg, "cuda"), opts.settings["symm_mem_all_reduce"],
        opts.settings["collective_wait"], opts.settings["overlap_comm"] is True,
    )  # fmt: skip


register_parallel_compile(compile_parallel)
