"""The ranks of a tensor-parallel group agree before they communicate, or all stop.

A tensor-parallel model is one model cut in pieces, so each rank must cut the same one,
with the same plan, and call it with the same shapes; otherwise the shards belong to
no model (each rank took its slice of its own weights) or the ranks issue different
collectives and one waits for the other until the group's timeout. Nothing a rank
holds can tell it what its peers hold, so every check here is one collective over
the group that every rank takes part in, and every rank raises: the rank at fault its
own error, each other a :class:`~boost_compiler.errors.PeerRankError` naming it.
Values are made equal where that is the meaning (rank 0's parameters and buffers,
broadcast as DDP and FSDP do when they wrap a model); what cannot be made equal (a
plan file, a batch's shapes) is compared and a difference refused by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..device import group_backend, pick_device
from ..errors import PeerRankError, RankMismatchError, ShardingError
from ..tp.groups import TPGroup

#: What a rank sends in place of its values when its own preparation raised.
_FAILED = "__boost_failed__"


def _process_group(group: TPGroup | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(group, dist.ProcessGroup):
        return group
    return dist.distributed_c10d._resolve_process_group(group.name)


def _communicates(pg: dist.ProcessGroup) -> bool:
    # The fake group (structure tests, one process) moves no bytes: nothing to agree on.
    return pg.size() > 1 and group_backend(pg, pick_device()) != "fake"


def _object_device(pg: dist.ProcessGroup) -> contextlib.AbstractContextManager[Any]:
    """The device an object collective runs on, this rank's own.

    On a group that moves no CPU tensors (NCCL alone), ``all_gather_object`` pickles into
    a tensor on ``torch.cuda.current_device()``. A script that never called
    ``torch.cuda.set_device`` leaves every rank on device 0, and NCCL then refuses (or
    hangs on) a collective whose ranks share a GPU. Under torchrun the rank's device is
    ``LOCAL_RANK`` modulo the devices it sees: used for this collective where the current
    device is still the default, without changing the process's setting.
    """
    local = os.environ.get("LOCAL_RANK")
    if local is None or not torch.cuda.is_available() or group_backend(pg, "cpu") is not None:
        return contextlib.nullcontext()
    want = int(local) % torch.cuda.device_count()
    if torch.cuda.current_device() != 0 or want == 0:
        return contextlib.nullcontext()  # set by the script (or already the rank's own)
    return torch.cuda.device(want)


def input_signature(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> list[str]:
    """What a call's collectives depend on: each tensor's shape and dtype, other leaves'
    values, by their place in the call (``args[0]``, ``['labels']``)."""
    leaves, _ = tree_flatten_with_path((tuple(args), dict(kwargs or {})))
    out = []
    for path, leaf in leaves:
        head = f"args[{path[1].idx}]" if path[0].idx == 0 else str(path[1].key)
        where = head + keystr(path[2:])
        if isinstance(leaf, torch.Tensor):
            out.append(f"{where}: {list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            out.append(f"{where}: {repr(leaf)[:80]}")
        else:
            out.append(f"{where}: {type(leaf).__name__}")
    return out


def canonical(value: Any) -> Any:
    """``value`` with what differs between processes for no reason (a function's address in
    its ``repr``) replaced by its type: options may hold callables (Inductor hooks)."""
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def digest(value: Any) -> str:
    """A short digest of a JSON-able value (plans and model structures are large)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def agree(
    group: TPGroup | dist.ProcessGroup, what: str, mine: Mapping[str, Any] | BaseException
) -> None:
    """Every rank of ``group`` calls this once at the same point; all return or all raise.

    ``mine``: this rank's values (compared key by key) or the exception its own
    preparation raised (re-raised here, after the peers have heard of it).
    """
    pg = _process_group(group)
    if not _communicates(pg):
        if isinstance(mine, BaseException):
            raise mine
        return
    failed = isinstance(mine, BaseException)
    payload = {_FAILED: f"{type(mine).__name__}: {mine}"} if failed else dict(mine)
    table: list[Any] = [None] * pg.size()
    with _object_device(pg):
        dist.all_gather_object(table, payload, group=pg)
    if failed:
        raise mine  # type: ignore[misc]
    for rank, theirs in enumerate(table):
        if _FAILED in theirs:
            first = str(theirs[_FAILED]).splitlines()[0][:500]
            raise PeerRankError(
                f"{what}: {_who(pg, rank)} of {pg.size()} failed ({first}); this rank "
                f"({_who(pg, pg.rank())}) stops with it, nothing was modified here"
            )
    for key in table[0]:
        values = [theirs.get(key) for theirs in table]
        if any(v != values[0] for v in values[1:]):
            shown = _shown(values)
            raise RankMismatchError(
                f"{what}: the ranks differ in {key} ({shown}). Every rank "
                "must run the same program on the same shapes: give each rank the same "
                f"{key}"
            )


def _who(pg: dist.ProcessGroup, rank: int) -> str:
    """``rank r`` of the group, with its global rank where the two differ (a TP group of a
    dp x tp job: the logs name global ranks)."""
    try:
        world = dist.get_global_rank(pg, rank)
    except (RuntimeError, ValueError):  # the fake group (one process) maps no ranks
        world = rank
    return f"rank {rank}" if world == rank else f"rank {rank} (global rank {world})"


def _shown(values: list[Any]) -> str:
    """Each rank's value; of lists (a model's tensors, a call's inputs: long), only the
    first entry where the ranks differ, so that the message names it."""
    if not all(isinstance(v, list) for v in values):
        return "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    longest = max(len(v) for v in values)

    def at(v: list[Any], i: int) -> list[Any]:  # [] past the end: a shorter list differs
        return [v[i]] if i < len(v) else []

    i = next((i for i in range(longest) if any(at(v, i) != at(values[0], i) for v in values)), 0)
    return f"entry {i} of {longest}: " + "; ".join(
        f"rank {r}: {v[i] if i < len(v) else f'none (it has {len(v)})'}"
        for r, v in enumerate(values)
    )


def broadcast_from_first(model: nn.Module, group: TPGroup) -> int:
    """Rank 0's values of the tensors ``model`` holds on every rank of ``group``.

    What DDP and FSDP do when they wrap a model: ranks that built it from different
    seeds (a script without ``torch.manual_seed``) then hold one model, rank 0's. Beyond
    their parameters and buffers, this covers the tensors a module keeps as plain
    attributes (``self.proj = torch.randn(d, r)``, :func:`held_tensors`): the forward reads
    them as it reads a buffer, and traced graphs hold them as constants. One broadcast per
    entry of :func:`held_tensors` that has values (not meta), in its order, which every
    rank agreed on before (``parallelize``'s agreement): an alias is sent twice, harmlessly,
    so the ranks' broadcasts pair one for one whatever aliases each holds. Returns how many
    tensors were broadcast.
    """
    pg = _process_group(group)
    if not _communicates(pg):
        return 0
    sent = 0
    with torch.no_grad():
        for _, t in held_tensors(model):
            if not t.is_meta:
                _broadcast_into(t, pg)
                sent += 1
    return sent


def _broadcast_into(t: torch.Tensor, pg: dist.ProcessGroup) -> None:
    """Rank 0's values into ``t``, whatever its layout or device.

    Collectives need contiguous memory (NCCL and gloo refuse a transposed view), bool goes
    as bytes (gloo has no bool kernel on every build), a CPU attribute on an NCCL-only group
    goes through the accelerator: the values travel in a contiguous staging copy on a device
    the group serves, written back into the tensor as it is laid out.
    """
    data = t.data
    device = data.device if group_backend(pg, data.device) is not None else pick_device()
    wire = data if data.is_contiguous() and device == data.device else data.contiguous().to(device)
    dist.broadcast(wire.view(torch.uint8) if wire.dtype == torch.bool else wire, group=pg,
                   group_src=0)  # fmt: skip
    if wire is not data:
        data.copy_(wire)


def held_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter and buffer of ``model``, and of every tensor a
    module holds as a plain attribute, directly or one level inside a list, tuple or dict
    (``blocks.0.proj``, ``cache[1]``, ``table['k']``; a key that is no string or number is
    named by its position: its ``repr`` may differ between processes). Not searched: sets,
    deeper containers, other objects' attributes. Fixed order; an alias of a parameter or
    buffer is left out, other aliases are listed under each name.

    A plain attribute whose values a broadcast cannot write back raises a
    :class:`~boost_compiler.errors.ShardingError` naming it, here, before any collective (in
    ``parallelize``'s checks, so every rank stops): a sparse or other non-strided tensor, a
    tensor subclass (a DTensor), an expanded view whose elements overlap, an inference-mode
    tensor.
    """
    found = [*model.named_parameters(), *model.named_buffers()]
    registered = {id(t) for _, t in found}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            for key, v in _entries(value):
                if isinstance(v, torch.Tensor) and id(v) not in registered:
                    name = f"{prefix}{attr}{key}"
                    _check_broadcastable(name, v)
                    found.append((name, v))
    return found


def _entries(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{k!r}]" if isinstance(k, (str, int)) else f"[#{i}]", v)
                for i, (k, v) in enumerate(value.items())]  # fmt: skip
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return [("", value)]


def _check_broadcastable(name: str, t: torch.Tensor) -> None:
    why = (
        "a tensor subclass" if type(t) is not torch.Tensor
        else "not a strided (dense) tensor" if t.layout != torch.strided
        else "an inference-mode tensor" if t.is_inference()
        else "an expanded view whose elements overlap" if torch._debug_has_internal_overlap(t) == 1
        else ""
    )  # fmt: skip
    if why:
        raise ShardingError(
            f"{name}: a tensor held as a plain module attribute, {why}: parallelize sends rank "
            "0's values of every tensor a model holds to the other ranks and cannot write "
            "them into this one. Register it as a buffer of its base values, or compute it "
            "in forward"
        )


__all__ = [
    "agree",
    "broadcast_from_first",
    "canonical",
    "digest",
    "held_tensors",
    "input_signature",
]
