"""Collectives issued as start/wait op pairs whose wait polls on CPU process groups.

Invariant: each ``_c10d_functional`` all-reduce / all-gather whose only user is its
``wait_tensor`` becomes a start (at the collective's place: the same collective on the
same process group, issued in the same order on every rank) and a wait (at the wait's
place). An all-reduce reduces in place into a fresh clone of its input
(``boost::all_reduce_start_``; ``boost::collective_wait_``, both declared mutations of the
clone, which the wait's readers read): no copy but the clone, which Inductor fuses into the
kernel computing the input, as in its own lowering of an all-reduce. An all-gather writes
a new tensor (``boost::all_gather_start``; ``boost::collective_wait`` returns it) from a
fresh clone of its input, which the wait reads too: gloo reads the input until the wait,
and a buffer no kernel writes and that lives until then cannot be reused by the work
scheduled in between (torch's own wait kernel lists its collective's inputs as reads for
the same reason). A
reduce-scatter on gloo, which gloo runs as an all-reduce of the whole input and a copy of
the rank's chunk inside ``wait()`` (so it cannot be polled), becomes that: the in-place
all-reduce and ``boost::scatter_wait``, which copies the chunk out (the same bytes on the
wire and the same copy). Anything else (a collective with other users, an unknown reduce
op, a reduce-scatter that gloo does not move; without ``overlap_comm``, one that would not
be polled) is left as it was. Where the wait then goes is :mod:`.overlap`'s business.

Why: ``wait_tensor`` blocks on a condition variable. With gloo on a machine of a few cores
(a VM's vCPUs) the waiting core goes idle, and the wake-up when the peer's data arrives
costs more than the transfer: measured on this project's 2-vCPU machines, a 4 KiB
all-reduce between two idle processes takes 3.4 ms (median; 0.3 ms at best), and 0.17-0.4
ms when the waiter polls. MPI libraries busy-poll their progress engines for the same
reason. The poll yields the core between checks (``sched_yield``), so gloo's own threads,
which do the transfer, are not starved. On NCCL the wait is a stream dependency, not a
CPU sleep: ``auto`` polls the collectives gloo moves only (decided per collective, from
its tensor's device: one group can hold NCCL for CUDA tensors and gloo for CPU ones) and
blocks elsewhere.
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
# in flight: the storage of a start's result -> its Work (the wait takes it out)
_PENDING: dict[int, Any] = {}


def _group(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _reduce_op(name: str) -> Any:
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name.upper())


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _complete(work: Any, poll: bool) -> None:
    """Wait for ``work``; polling: yield the core until it completes, for at most
    :data:`POLL_S`, then block (a slow peer is not worth a spinning core)."""
    if poll:
        deadline = time.perf_counter() + POLL_S
        while not work.is_completed() and time.perf_counter() < deadline:
            os.sched_yield()
    work.wait()  # raises the collective's error (a timeout, a peer gone), if any


@torch.library.custom_op("boost::all_reduce_start_", mutates_args=("x",))
def all_reduce_start_(x: torch.Tensor, reduce_op: str, group_name: str) -> None:
    """Issue an all-reduce of ``x`` in place; ``x`` is read again only after
    :func:`collective_wait_` on it. The pass gives it a fresh contiguous clone of the
    collective's input (an ``aten.clone`` Inductor fuses into the kernel that computes it),
    so no other value shares the buffer the reduction writes into."""
    import torch.distributed as dist

    work = dist.all_reduce(x, op=_reduce_op(reduce_op), group=_group(group_name), async_op=True)
    _PENDING[_key(x)] = work


@torch.library.custom_op("boost::collective_wait_", mutates_args=("x",))
def collective_wait_(x: torch.Tensor, poll: bool) -> None:
    """Complete the in-place collective :func:`all_reduce_start_` issued on ``x``: after
    it, ``x`` holds the result (declared a mutation, so every later read is ordered after
    it, and nothing is copied)."""
    work = _PENDING.pop(_key(x), None)
    if work is None:
        raise RuntimeError("boost::collective_wait_: no collective in flight for this tensor")
    _complete(work, poll)


@torch.library.custom_op("boost::all_gather_start", mutates_args=())
def all_gather_start(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Issue ``_c10d_functional.all_gather_into_tensor`` (the ranks' inputs stacked on dim 0);
    read it through :func:`collective_wait` only, which must also be given ``x``: gloo
    reads ``x`` until then."""
    import torch.distributed as dist

    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    # all_gather_single: torch 2.13 deprecates all_gather_into_tensor with a FutureWarning
    # every user of a polled all-gather would see as if torch's own
    work = dist.all_gather_single(out, x.contiguous(), group=_group(group_name), async_op=True)
    _PENDING[_key(out)] = work
    return out


@all_gather_start.register_fake
def _(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))


@torch.library.custom_op("boost::collective_wait", mutates_args=())
def collective_wait(x: torch.Tensor, poll: bool, sent: torch.Tensor) -> torch.Tensor:
    """The completed result of the start that returned ``x`` (a copy: an op's output may
    not alias its input). ``sent``, the start's input, is only read: so that Inductor
    keeps its buffer, which gloo may still be sending, from the work scheduled between
    start and wait (measured: an overlapped all-gather's input reused by a kernel in
    between sent that kernel's values, silently, to the peer)."""
    work = _PENDING.pop(_key(x), None)
    if work is None:
        raise RuntimeError("boost::collective_wait: no collective in flight for this tensor")
    _complete(work, poll)
    return x.clone()


@collective_wait.register_fake
def _(x: torch.Tensor, poll: bool, sent: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("boost::scatter_wait", mutates_args=())
def scatter_wait(x: torch.Tensor, poll: bool, group_size: int, group_name: str) -> torch.Tensor:
    """Complete the all-reduce :func:`all_reduce_start_` issued on ``x`` and return this
    rank's ``1/group_size`` of it along dim 0: a reduce-scatter as gloo runs one (gloo's
    ``reduce_scatter_tensor`` all-reduces the whole input and copies the rank's chunk out
    when waited for, which is why it cannot be polled). The rank is read from the group
    when the op runs, not baked into the graph, so ranks may share compiled code."""
    work = _PENDING.pop(_key(x), None)
    if work is None:
        raise RuntimeError("boost::scatter_wait: no collective in flight for this tensor")
    _complete(work, poll)
    chunk = x.chunk(group_size)[_group(group_name).rank()]
    return chunk.clone(memory_format=torch.contiguous_format)


@scatter_wait.register_fake
def _(x: torch.Tensor, poll: bool, group_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


# functional collective -> (its start op, position of its reduce op among the arguments)
STARTS = {
    _FUNCOL.all_reduce.default: (torch.ops.boost.all_reduce_start_.default, 1),
    _FUNCOL.all_gather_into_tensor.default: (torch.ops.boost.all_gather_start.default, None),
    _FUNCOL.reduce_scatter_tensor.default: (torch.ops.boost.all_reduce_start_.default, 1),
}
# the start ops that reduce in place into their first argument, with their wait
IN_PLACE = frozenset({torch.ops.boost.all_reduce_start_.default})
WAIT = torch.ops.boost.collective_wait.default
WAIT_IN_PLACE = torch.ops.boost.collective_wait_.default
SCATTER_WAIT = torch.ops.boost.scatter_wait.default
WAITS = frozenset({WAIT, WAIT_IN_PLACE, SCATTER_WAIT})


def polls(group_name: str, mode: str, device: torch.device | None = None) -> bool:
    """Whether a collective moving ``device``'s tensors on ``group_name`` is polled under
    option ``collective_wait``: under ``auto``, where gloo moves them (a group made with
    ``"cuda:nccl,cpu:gloo"`` polls its CPU tensors' collectives, not its CUDA ones'); an
    unknown device or group blocks, which costs latency, never a value."""
    if mode in ("block", "poll"):
        return mode == "poll"
    if device is None:
        return False
    from ..device import group_backend

    try:
        return group_backend(_group(group_name), device) == "gloo"
    except (RuntimeError, ValueError, KeyError):  # not a live group (a traced fake one)
        return False


def _device(node: fx.Node) -> torch.device | None:
    """The device of the tensor the collective ``node`` moves, as traced."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return val.device if isinstance(val, torch.Tensor) else None


def split_collectives(graph: fx.Graph, mode: str = "auto", split_blocking: bool = True) -> int:
    """Rewrite ``graph`` in place (see the module docstring); returns collectives rewritten.
    ``split_blocking=False``: a collective that would not be polled is left as it was."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in STARTS:
            continue
        users = list(node.users)
        if node.kwargs or not isinstance(node.args[-1], str) or len(users) != 1:
            continue
        wait = users[0]
        start_op, op_at = STARTS[node.target]
        if wait.target is not _FUNCOL.wait_tensor.default:
            continue
        if op_at is not None and node.args[op_at] not in _REDUCE_OPS:
            continue
        poll = polls(node.args[-1], mode, _device(node))
        if not (poll or split_blocking):
            continue
        if node.target is _FUNCOL.reduce_scatter_tensor.default:
            if not _on_gloo(node):  # elsewhere a reduce-scatter is its own, cheaper collective
                continue
            new = _scatter(graph, node, wait, poll)
        elif start_op in IN_PLACE:
            new = _in_place(graph, node, wait, start_op, poll)
        else:
            new = _out_of_place(graph, node, wait, start_op, poll)
        wait.replace_all_uses_with(new)
        graph.erase_node(wait)
        graph.erase_node(node)
        done += 1
    return done


def _on_gloo(node: fx.Node) -> bool:
    """Whether gloo moves the tensor of the collective ``node`` (a live group only)."""
    from ..device import group_backend

    device = _device(node)
    try:
        return device is not None and group_backend(_group(node.args[-1]), device) == "gloo"
    except (RuntimeError, ValueError, KeyError):
        return False


def _start_on_clone(
    graph: fx.Graph, node: fx.Node, start_op: Any, *rest: Any
) -> tuple[fx.Node, fx.Node]:
    """``clone(x)`` of the collective ``node``'s input and ``start_op(clone, *rest)``, at
    its place: the buffer that only the start, its wait and (for an in-place reduction) the
    wait's readers touch, contiguous as gloo needs it."""
    x = node.args[0]
    with graph.inserting_before(node):
        buf = graph.call_function(
            torch.ops.aten.clone.default, (x,), {"memory_format": torch.contiguous_format}
        )
        start = graph.call_function(start_op, (buf, *rest))
    buf.meta = {k: v for k, v in _meta(node).items() if k != "val"}
    if isinstance(x, fx.Node) and "val" in x.meta:
        buf.meta["val"] = _contiguous(x.meta["val"])
    return buf, start


def _scatter(graph: fx.Graph, node: fx.Node, wait: fx.Node, poll: bool) -> fx.Node:
    """A gloo reduce-scatter as gloo runs it, with a wait that polls: the in-place
    all-reduce of :func:`_in_place` on a clone of the input, and :func:`scatter_wait`
    returning this rank's chunk of it (the copy gloo's own wait makes)."""
    _, reduce_op, group_size, group_name = node.args
    buf, start = _start_on_clone(graph, node, STARTS[node.target][0], reduce_op, group_name)
    with graph.inserting_before(wait):
        done = graph.call_function(SCATTER_WAIT, (buf, poll, group_size, group_name))
    start.meta = {k: v for k, v in _meta(node).items() if k != "val"}
    done.meta = _meta(wait)
    return done


def _out_of_place(
    graph: fx.Graph, node: fx.Node, wait: fx.Node, start_op: Any, poll: bool
) -> fx.Node:
    """``clone(x)``, the start reading it and the wait reading it too (see the module
    docstring): the node the wait's readers read instead."""
    sent, start = _start_on_clone(graph, node, start_op, *node.args[1:])
    with graph.inserting_before(wait):
        new = graph.call_function(WAIT, (start, poll, sent))
    start.meta = _meta(node)
    new.meta = _meta(wait)
    return new


def _meta(node: fx.Node) -> dict[str, Any]:
    """A replaced node's value and provenance; not eager_input_vals (its own arguments)."""
    return {k: v for k, v in node.meta.items() if k != "eager_input_vals"}


def _in_place(graph: fx.Graph, node: fx.Node, wait: fx.Node, start_op: Any, poll: bool) -> fx.Node:
    """``clone(x)``, the start reducing into it and its wait, both declared mutations of
    it: the node the wait's readers read instead. The clone is a fresh buffer no other
    value aliases (what torch's own Inductor lowering of an all-reduce does: Inductor
    fuses the copy into the kernel that computes ``x``), so neither start nor wait copies,
    where the out-of-place pair copied the payload twice."""
    buf, start = _start_on_clone(graph, node, start_op, *node.args[1:])
    with graph.inserting_before(wait):
        done = graph.call_function(WAIT_IN_PLACE, (buf, poll))
    start.meta = {k: v for k, v in _meta(node).items() if k != "val"}
    done.meta = {k: v for k, v in _meta(wait).items() if k != "val"}
    return buf


def _contiguous(val: Any) -> Any:
    """The recorded value of a contiguous clone of ``val``. Inductor gives a custom op's
    inputs the strides their nodes record, and the collective needs a contiguous buffer
    (gloo refuses others); a traced value is a fake tensor, cloned in its own mode."""
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return val
    return val.clone(memory_format=torch.contiguous_format)
