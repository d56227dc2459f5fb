"""Option ``symm_mem_all_reduce``: Inductor's own rule picks the small all-reduces.

A one-shot all-reduce needs CUDA symmetric memory, so on this CPU machine the check stops
at Inductor's decision: compiling the tiny CoLA-LLaMA at tp=2 on torch's fake group, a
spy on ``comm_lowering._should_lower_as_one_shot_all_reduce`` records, per all-reduce
Inductor lowers, its bytes and the rule's answer, then lowers it as an NCCL-style
all-reduce so that compiling goes on. The spy calls the rule itself, with symmetric
memory mocked as enabled for the tensor-parallel group alone: what it records is which
all-reduces a GPU run would hand to ``one_shot_all_reduce`` (that op itself, and the
symmetric allocation, need CUDA). The Inductor cache is off: a cached graph lowers nothing.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch._inductor import comm_lowering
from torch.distributed._symmetric_memory import _test_mode

import boost_compiler
from boost_compiler.errors import OptionError
from boost_compiler.lowering.symm_mem import inductor_patches
from boost_compiler.tp.collectives import fake_process_group
from examples.cola_llama import build, example_inputs


def _decisions(options: dict[str, Any]) -> list[tuple[int, bool]]:
    """(bytes, lowered one-shot?) of every all-reduce Inductor lowers, forward and backward."""
    seen: list[tuple[int, bool]] = []
    rule = comm_lowering._should_lower_as_one_shot_all_reduce

    def spy(inp: Any, reduce_op: str, group_name: str) -> bool:
        nbytes = int(inp.get_numel()) * inp.get_dtype().itemsize
        seen.append((nbytes, bool(rule(inp, reduce_op, group_name))))
        return False

    with (
        fake_process_group(2),
        _test_mode({dist.group.WORLD.group_name}),
        mock.patch.object(comm_lowering, "_should_lower_as_one_shot_all_reduce", spy),
    ):
        torch._dynamo.reset()
        model = build("tiny")
        (ids,) = example_inputs(model.cfg, batch=2, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
        fresh = {"inductor_config": {"force_disable_caches": True}}  # a cache hit lowers nothing
        opts = {**fresh, **options}  # collective_wait "auto": torch's waits off gloo
        run = torch.compile(model, backend="boost", options=opts)
        run(ids, labels=ids).backward()
    torch._dynamo.reset()
    return seen


def test_all_reduces_up_to_the_threshold_are_lowered_one_shot() -> None:
    every = _decisions({"symm_mem_all_reduce": 1 << 30})
    cut = 2 * 16 * 16 * 4  # the tiny model's [b, s, r] at the narrow cut, fp32
    # every BTP cut (and anything larger) is lowered one-shot; a few bytes of norm
    # statistics read straight from a graph input Inductor does not allocate stay NCCL's
    assert all(one_shot for n, one_shot in every if n >= cut), every
    assert sum(n == cut for n, _ in every) >= 4
    some = _decisions({"symm_mem_all_reduce": cut})
    assert [n for n, _ in some] == [n for n, _ in every]  # the same all-reduces, in order
    assert [o for _, o in some] == [o and n <= cut for n, o in every], some
    assert any(n > cut for n, _ in some)  # the threshold is what left those out


def test_refused_off_nccl_and_with_split_collectives() -> None:
    assert inductor_patches("tp", "gloo", 0, "auto", False) == {}  # off: no check at all
    with pytest.raises(OptionError, match="'gloo'"):
        inductor_patches("tp", "gloo", 1 << 20, "auto", False)
    with pytest.raises(OptionError, match="collective_wait='poll'"):
        inductor_patches("tp", "fake", 1 << 20, "poll", False)
    with pytest.raises(OptionError, match="overlap_comm"):
        inductor_patches("tp", "fake", 1 << 20, "block", True)
    for wait in ("auto", "block"):
        patches = inductor_patches("tp", "fake", 4096, wait, False)
        assert patches == {
            "_collective.auto_select": True,
            "_collective.one_shot_all_reduce_threshold_bytes": 4096,
        }


def test_an_nccl_group_gets_symmetric_memory() -> None:
    """Inductor's rule asks ``is_symm_mem_enabled_for_group``: the option enables it."""
    import torch.distributed._symmetric_memory as symm

    with mock.patch.object(symm, "enable_symm_mem_for_group") as enable:
        inductor_patches("tp0", "fake", 1 << 20, "auto", False)
        enable.assert_not_called()  # torch's fake group has no symmetric memory
        inductor_patches("tp0", "nccl", 1 << 20, "auto", False)
        enable.assert_called_once_with("tp0")
