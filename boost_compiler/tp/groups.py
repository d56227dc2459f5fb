"""Process groups as the compiler's graphs name them, and a fake group for structure tests.

Every collective in a graph takes its group by *name* (a ``str``), which dynamo,
``make_fx`` and Inductor all treat as a literal; the rank and size are resolved
from the name at trace time and baked into the graph, so that a graph built for
one rank cannot silently run on another (:func:`rank_and_size` checks it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import MeshError

__all__ = ["fake_process_group", "group_name_of", "rank_and_size"]


def group_name_of(group: object = None) -> str:
    """The name string of a ProcessGroup, a 1-D DeviceMesh, or ``None`` (the world).

    A ``str`` is returned unchanged. For a ProcessGroup this is ``pg.group_name``;
    for a 1-D DeviceMesh it is ``mesh.get_group().group_name`` (equal to
    ``mesh._dim_group_names[0]``).
    """
    if isinstance(group, str):
        return group
    if group is None:
        return dist.group.WORLD.group_name  # type: ignore[union-attr]
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group_name_of needs a 1-D DeviceMesh, got {group.ndim}-D")
        return group.get_group().group_name
    raise TypeError(f"cannot derive a process-group name from {type(group).__name__}")


@torch.compiler.assume_constant_result
def _group_rank(group: str) -> int:
    # assume_constant_result: dynamo calls this at trace time and bakes the int in
    # (it cannot trace _resolve_process_group on a string itself).
    return dist.distributed_c10d._resolve_process_group(group).rank()


@torch.compiler.assume_constant_result
def _group_size(group: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group).size()


def rank_and_size(group: str, rank: int | None, world_size: int | None) -> tuple[int, int]:
    actual = (_group_rank(group), _group_size(group))
    if (rank, world_size) != (None, None) and (rank, world_size) != actual:
        raise ValueError(
            f"group {group!r}: this process is rank {actual[0]} of {actual[1]}, "
            f"the graph was built for rank={rank}, world_size={world_size}"
        )
    return actual


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[str]:
    """Initialise torch's fake process group in this process; yields its name.

    Collectives on it do no communication and their values are not those of a
    real group (all-reduce leaves its input as is), but every primitive above
    runs eagerly and traces through dynamo, AOT and Inductor with the world size
    given, so graph-structure tests need no second process. The group is
    destroyed on exit. Fails if a default group already exists.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield group_name_of(None)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group as the passes see it: its c10d name, size, this rank."""

    name: str
    size: int
    rank: int


def resolve_group(mesh_or_group: Any) -> TPGroup:
    """A 1-D DeviceMesh or a ProcessGroup -> name, size, this rank's index."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise MeshError(
                f"parallelize needs a 1-D tensor-parallel mesh, got a {mesh_or_group.ndim}-D "
                f"mesh with dims {mesh_or_group.mesh_dim_names}; pass mesh['tp']"
            )
        pg = mesh_or_group.get_group()
    elif isinstance(mesh_or_group, dist.ProcessGroup):
        pg = mesh_or_group
    else:
        raise MeshError(
            f"parallelize takes a 1-D DeviceMesh or a ProcessGroup, got {type(mesh_or_group)!r}"
        )
    return TPGroup(group_name_of(pg), dist.get_world_size(pg), dist.get_rank(pg))
