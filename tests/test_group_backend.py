"""Which backend moves which device's tensors on a process group (issue 42, item 3).

``device.process_group_backend`` makes a CUDA machine's groups with ``"cuda:nccl,cpu:gloo"``,
and ``dist.get_backend`` then returns that whole string: the options that depend on the
backend (``symm_mem_all_reduce``, ``collective_wait="auto"``) are decided per device by
``device.group_backend``. A one-process group with a per-device backend string is real
here; NCCL is not built into this CPU torch, so the CUDA machine's string is what torch
would report, patched into ``get_backend`` and ``get_backend_config`` alike.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from boost_compiler.device import group_backend
from boost_compiler.errors import OptionError
from boost_compiler.lowering import split_collectives
from boost_compiler.lowering.poll_waits import polls
from boost_compiler.tp.groups import fake_process_group, group_name_of, resolve_group

CUDA_MACHINE = "cuda:nccl,cpu:gloo"  # process_group_backend("cuda")


@pytest.fixture
def one_rank() -> Iterator[Any]:
    """Starts a one-process group with the backend string given."""
    made: list[bool] = []

    def start(backend: str) -> Any:
        path = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
        made.append(True)
        return dist.group.WORLD

    yield start
    if made:
        dist.destroy_process_group()


def _as_on_a_cuda_machine() -> Any:
    """What torch reports for a group made with ``CUDA_MACHINE``, on this gloo group."""
    return mock.patch.multiple(
        dist, get_backend=lambda *_: CUDA_MACHINE, get_backend_config=lambda *_: CUDA_MACHINE
    )


def test_each_device_gets_its_own_backend(one_rank: Any) -> None:
    pg = one_rank("cpu:gloo")
    assert dist.get_backend(pg) == "cpu:gloo"  # not a backend's name: why the helper
    assert group_backend(pg, "cpu") == "gloo"
    assert group_backend(pg, torch.device("cuda", 1)) is None  # no backend for CUDA
    with _as_on_a_cuda_machine():
        assert group_backend(pg, "cpu") == "gloo"
        assert group_backend(pg, "cuda:0") == "nccl"


def test_plain_backends() -> None:
    with fake_process_group(2):
        assert group_backend(dist.group.WORLD, "cuda") == "fake"
    for config, cpu, cuda in (("cpu:gloo,cuda:gloo", "gloo", "gloo"), ("nccl", "nccl", "nccl")):
        with mock.patch.object(dist, "get_backend_config", lambda *_, c=config: c):
            assert (group_backend(None, "cpu"), group_backend(None, "cuda")) == (cpu, cuda)


def test_auto_polls_what_gloo_moves(one_rank: Any) -> None:
    """CPU tensors' collectives go through gloo: polled; CUDA ones' through NCCL: not."""
    pg = one_rank("cpu:gloo")
    name = group_name_of(pg)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert polls(name, "auto", cpu) is True
    assert polls(name, "auto", cuda) is False  # no CUDA backend on this group
    assert polls(name, "auto", None) is False  # unknown device: block (latency, not values)
    assert polls(name, "poll", cuda) is True and polls(name, "block", cpu) is False
    with _as_on_a_cuda_machine():
        assert polls(name, "auto", cpu) is True
        assert polls(name, "auto", cuda) is False


def _all_reduce_graph(name: str, val: torch.Tensor) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = val
    c = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", name))
    g.output(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (c,)))
    return g


def test_split_decides_by_the_traced_tensors_device(one_rank: Any) -> None:
    name = group_name_of(one_rank("cpu:gloo"))
    with FakeTensorMode():
        on_cpu, on_cuda = torch.empty(2), torch.empty(2, device="cuda")
    with _as_on_a_cuda_machine():
        for val, want in ((on_cpu, True), (on_cuda, False)):
            g = _all_reduce_graph(name, val)
            assert split_collectives(g, "auto") == 1
            (wait,) = [n for n in g.nodes if n.target is torch.ops.boost.collective_wait_.default]
            assert wait.args[1] is want, val.device


def test_symm_mem_is_decided_by_the_cuda_backend(one_rank: Any) -> None:
    """The project's own CUDA groups (``cuda:nccl,cpu:gloo``) get symmetric memory; a
    group with no NCCL for CUDA tensors is refused, by name."""
    import torch.distributed._symmetric_memory as symm

    from boost_compiler.options import BoostOptions
    from boost_compiler.parallel.runtime import _symm_mem_patches

    tp = resolve_group(one_rank("cpu:gloo"))
    opts = BoostOptions.parse({"symm_mem_all_reduce": 4096})
    with _as_on_a_cuda_machine(), mock.patch.object(symm, "enable_symm_mem_for_group") as on:
        patches = _symm_mem_patches(tp, opts)
    on.assert_called_once_with(tp.name)
    assert patches["_collective.one_shot_all_reduce_threshold_bytes"] == 4096
    with pytest.raises(OptionError, match="moves CUDA tensors with None"):
        _symm_mem_patches(tp, opts)


def test_auto_overlap_where_the_waits_poll(one_rank: Any) -> None:
    """``overlap_comm="auto"`` (the default): on for the collectives gloo moves (CPU
    tensors), off for NCCL's (CUDA tensors on the CUDA machine's group) and under blocking
    waits; an explicit ``True``/``False`` stands; ``symm_mem_all_reduce`` on NCCL is not
    refused for an overlap it does not get."""
    from boost_compiler.options import BoostOptions
    from boost_compiler.parallel.runtime import _resolve_overlap

    tp = resolve_group(one_rank("cpu:gloo"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    def overlap(device: torch.device, **options: Any) -> Any:
        return _resolve_overlap(BoostOptions.parse(options), tp, device).settings["overlap_comm"]

    assert BoostOptions.parse({}).settings["overlap_comm"] == "auto"
    with _as_on_a_cuda_machine():
        assert overlap(cpu) is True and overlap(cuda) is False
        assert overlap(cpu, collective_wait="block") is False
        assert overlap(cuda, collective_wait="poll") is True
        assert overlap(cpu, overlap_comm=False) is False and overlap(cuda, overlap_comm=True)
        import torch.distributed._symmetric_memory as symm

        from boost_compiler.parallel.runtime import _symm_mem_patches

        opts = _resolve_overlap(BoostOptions.parse({"symm_mem_all_reduce": 64}), tp, cuda)
        with mock.patch.object(symm, "enable_symm_mem_for_group"):
            assert _symm_mem_patches(tp, opts)
    with pytest.raises(OptionError, match="overlap_comm"):
        BoostOptions.parse({"overlap_comm": "sometimes"})
