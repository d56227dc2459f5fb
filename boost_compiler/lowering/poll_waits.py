"""Collectives on CPU process groups waited for by polling, not by sleeping.

Invariant: each ``_c10d_functional`` all-reduce / all-gather whose only
user is its ``wait_tensor`` becomes one ``boost::*_polled`` op at the collective's place in
the graph: the same collective on the same process group, issued in the same order on
every rank, returning the same tensor; only the wait differs. Anything else (a collective
with other users, a group of another backend, an unknown reduce op) is left as it was.

Why: ``wait_tensor`` blocks on a condition variable. With gloo on a machine of a few cores
(a VM's vCPUs) the waiting core goes idle, and the wake-up when the peer's data arrives
costs more than the transfer: measured on this project's 2-vCPU machines, a 4 KiB
all-reduce between two idle processes takes 3.4 ms (median; 0.3 ms at best), and 0.17-0.4
ms when the waiter polls. MPI libraries busy-poll their progress engines for the same
reason. The poll yields the core between checks (``sched_yield``), so gloo's own threads,
which do the transfer, are not starved. On NCCL the wait is a stream dependency, not a
CPU sleep: ``auto`` polls gloo groups only.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.fx as fx

_FUNCOL = torch.ops._c10d_functional
_REDUCE_OPS = ("sum", "max", "min", "product", "avg")
POLL_S = 0.05  # past this, a wait blocks: a peer that late is not a wake-up's latency


def _group(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _reduce_op(name: str) -> Any:
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name.upper())


def _poll(work: Any) -> None:
    """Yield the core until ``work`` completes, for at most :data:`POLL_S`; then block.

    The deadline bounds the spin where a peer is slow (or a Work only completes inside
    ``wait()``: gloo's emulated reduce-scatter does, which is why it is not polled).
    """
    deadline = time.perf_counter() + POLL_S
    while not work.is_completed() and time.perf_counter() < deadline:
        os.sched_yield()
    work.wait()  # raises the collective's error (a timeout, a peer gone), if any


@torch.library.custom_op("boost::all_reduce_polled", mutates_args=())
def all_reduce_polled(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """``_c10d_functional.all_reduce`` + its ``wait_tensor``, the wait polled."""
    import torch.distributed as dist

    out = x.clone(memory_format=torch.contiguous_format)
    _poll(dist.all_reduce(out, op=_reduce_op(reduce_op), group=_group(group_name), async_op=True))
    return out


@all_reduce_polled.register_fake
def _(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("boost::all_gather_polled", mutates_args=())
def all_gather_polled(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """``_c10d_functional.all_gather_into_tensor`` + its wait (the ranks' inputs stacked on
    dim 0), the wait polled."""
    import torch.distributed as dist

    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    _poll(dist.all_gather_into_tensor(out, x.contiguous(), group=_group(group_name),
                                      async_op=True))  # fmt: skip
    return out


@all_gather_polled.register_fake
def _(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))


# functional collective -> (its polled op, position of its reduce op among the arguments)
POLLED = {
    _FUNCOL.all_reduce.default: (torch.ops.boost.all_reduce_polled.default, 1),
    _FUNCOL.all_gather_into_tensor.default: (torch.ops.boost.all_gather_polled.default, None),
}


def polls(group_name: str, mode: str) -> bool:
    """Whether a collective on ``group_name`` is polled under option ``collective_wait``."""
    if mode == "block":
        return False
    if mode == "poll":
        return True
    import torch.distributed as dist

    try:
        return dist.get_backend(_group(group_name)) == "gloo"
    except (RuntimeError, ValueError, KeyError):  # not a live group (a traced fake one)
        return False


def poll_waits(graph: fx.Graph, mode: str = "auto") -> int:
    """Rewrite ``graph`` in place (see the module docstring); returns collectives rewritten."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in POLLED:
            continue
        users = list(node.users)
        if (
            node.kwargs
            or not isinstance(node.args[-1], str)
            or len(users) != 1
            or users[0].target is not _FUNCOL.wait_tensor.default
        ):
            continue
        polled, op_at = POLLED[node.target]
        if op_at is not None and node.args[op_at] not in _REDUCE_OPS:
            continue
        if not polls(node.args[-1], mode):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(polled, tuple(node.args))
        # the wait's value and provenance; not its eager_input_vals (the wait's own args)
        new.meta = {k: v for k, v in users[0].meta.items() if k != "eager_input_vals"}
        users[0].replace_all_uses_with(new)
        graph.erase_node(users[0])
        graph.erase_node(node)
        done += 1
    return done
