"""The ranks of a tensor-parallel group end as one model, or all stop with a named error.

``parallelize`` broadcasts rank 0's parameters and buffers before cutting them, and
compares what cannot be made equal (parallel/agreement.py). Each case runs on one 2-process
gloo world; an error must reach every rank within seconds (the group's timeout, here
10 minutes, is what a rank left waiting in a collective would see).
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world

FAST_S = 30.0  # a hang guard: the checks compare in one collective, after planning


@pytest.fixture(scope="module")
def world() -> dict:
    names = ["seeds_differ", "plan_files_differ", "batch_shapes_differ", "one_rank_fails",
             "example_shapes_differ", "env_option_differs", "non_contiguous_differ",
             "plain_attributes_differ", "data_missing_on_one_rank"]  # fmt: skip
    return run_world(2, [(n, f"tests.agreement_checks:{n}", ()) for n in names])


def test_ranks_built_from_other_seeds_train_rank_0s_model(world: dict) -> None:
    for r in ranks(result_of(world, "seeds_differ")):
        for tp, one in zip(r["tp"], r["rank0"], strict=True):
            assert abs(tp - one) <= RTOL * abs(one), (r["rank"], r["tp"], r["rank0"])
        assert r["param_err"] <= RTOL, (r["rank"], r["param_err"])


def test_plain_tensor_attributes_are_rank_0s(world: dict) -> None:
    """Tensors a module holds outside its parameters and buffers are broadcast too: unseeded
    ranks would otherwise each scale by their own, a model that is no one's."""
    for r in ranks(result_of(world, "plain_attributes_differ")):
        for how in ("eager", "compiled"):
            for tp, one in zip(r[how], r["rank0"], strict=True):
                assert abs(tp - one) <= RTOL * abs(one), (r["rank"], how, r[how], r["rank0"])


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("plan_files_differ", "differ in plan (rank 0: forced by plan="),
        ("batch_shapes_differ", "differ in input shapes"),
        ("example_shapes_differ", "differ in example inputs"),
        ("env_option_differs", "differ in options"),
    ],
)
def test_a_difference_is_refused_on_every_rank(world: dict, case: str, words: str) -> None:
    for r in ranks(result_of(world, case)):
        assert r["raised"] == "RankMismatchError", r
        assert words in r["message"] and "rank 0:" in r["message"] and "rank 1:" in r["message"]
        assert r["seconds"] < FAST_S, r
        assert not r.get("modified"), "a parameter was modified before the error"


def test_data_missing_on_one_rank_stops_every_rank(world: dict) -> None:
    """``boost train`` checks its flags on every rank and agrees: the rank without the data
    names the file, its peer names that rank, both within seconds."""
    r0, r1 = ranks(result_of(world, "data_missing_on_one_rank"))
    assert r1["raised"] == "DataError" and "train.jsonl" in r1["message"], r1
    assert r0["raised"] == "PeerRankError" and "rank 1 of 2 failed" in r0["message"], r0
    assert "train.jsonl" in r0["message"]
    assert max(r0["seconds"], r1["seconds"]) < FAST_S


def test_transposed_parameters_and_buffers_are_broadcast(world: dict) -> None:
    for r in ranks(result_of(world, "non_contiguous_differ")):
        assert r["sent"] == 2 and r["equal"] and r["strides_kept"], r


def test_one_ranks_error_stops_every_rank(world: dict) -> None:
    r0, r1 = ranks(result_of(world, "one_rank_fails"))
    assert r1["raised"] == "UnknownOptionError", r1
    assert r0["raised"] == "PeerRankError" and "rank 1 of 2 failed" in r0["message"], r0
    assert "no_such_option" in r0["message"]
    assert max(r0["seconds"], r1["seconds"]) < FAST_S


# What one rank sends to agree(): compared without a world (parallel/parallelize.py's _shared). Each
# difference below is one that a 2-rank run would otherwise meet only as a hang.


def _sent(model, options=None, plan=None) -> dict:
    import torch

    from boost_compiler.parallel.parallelize import _shared
    from boost_compiler.tp.plan import TPPlan

    plan = plan if plan is not None else TPPlan(p=2, group="")
    return _shared(model, plan, options, (torch.zeros(2, 4),), None)


def test_options_are_compared_as_each_rank_resolves_them(monkeypatch) -> None:
    """compile_in_turns defaults from $BOOST_COMPILE_IN_TURNS, read on each rank: a rank
    where it is set takes barriers in its compile that the others never take."""
    import torch

    model = torch.nn.Linear(4, 4)
    monkeypatch.delenv("BOOST_COMPILE_IN_TURNS", raising=False)
    unset = _sent(model, {})
    monkeypatch.setenv("BOOST_COMPILE_IN_TURNS", "1")
    assert _sent(model, {})["options"] != unset["options"]
    assert "compile_in_turns" in str(_sent(model, {})["options"])


def test_a_rank_on_meta_differs_from_a_rank_with_values() -> None:
    """broadcast_from_first skips meta tensors: a rank built on meta would broadcast fewer
    tensors than rank 0, pairing the rest with other collectives."""
    import torch

    real = torch.nn.Linear(4, 4)
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    key = next(k for k in _sent(real) if "tensors" in k)
    assert _sent(real)[key] != _sent(meta)[key]
    assert _sent(real)[key] == _sent(torch.nn.Linear(4, 4))[key]


def test_plain_tensor_attributes_are_compared_before_their_broadcast() -> None:
    """A plain tensor attribute of another shape on one rank would pair rank 0's broadcast
    with a collective of another size: the ranks compare its name and shape first."""
    import torch

    one, two = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    one.table, two.table = torch.zeros(3), torch.zeros(5)
    key = next(k for k in _sent(one) if "tensors" in k)
    assert "table: [3] float32 cpu" in _sent(one)[key]
    assert _sent(one)[key] != _sent(two)[key]


def test_plain_attributes_a_broadcast_cannot_write_are_named_first() -> None:
    """An expanded view (overlapping elements), a sparse tensor, an inference tensor: no
    broadcast can write rank 0's values into them, so parallelize's checks refuse them by
    name (on every rank, before any collective); containers are named entry by entry, a
    key with no stable text by its position."""
    import torch

    from boost_compiler.errors import ShardingError
    from boost_compiler.parallel.agreement import held_tensors

    class Tagged(torch.Tensor):  # a tensor subclass, as DTensor is
        pass

    m = torch.nn.Linear(4, 4)
    m.cache = {"k": torch.zeros(2), object(): torch.ones(3)}
    m.pair = (torch.zeros(1), m.weight)  # an alias of a parameter: the parameter's entry only
    names = [n for n, _ in held_tensors(m)]
    assert names == ["weight", "bias", "cache['k']", "cache[#1]", "pair[0]"], names
    for bad, why in ((torch.ones(1, 3).expand(4, 3), "overlap"),
                     (torch.eye(3).to_sparse(), "not a strided"),
                     (torch.ones(2).as_subclass(Tagged), "subclass")):  # fmt: skip
        m.table = bad
        with pytest.raises(ShardingError, match=f"table: .*{why}"):
            held_tensors(m)
    with torch.inference_mode():
        m.table = torch.ones(2)
    with pytest.raises(ShardingError, match="inference-mode"):
        held_tensors(m)


def test_plans_with_other_collectives_differ() -> None:
    """The same placements, other collectives (a rule decided otherwise on one rank):
    the ranks would issue different collectives."""
    import torch

    from boost_compiler.tp.comm_table import Collective
    from boost_compiler.tp.plan import TPPlan

    model = torch.nn.Linear(4, 4)
    one, two = TPPlan(p=2, group=""), TPPlan(p=2, group="")
    two.collectives.append(Collective("all_reduce", "mm", (2, 4), torch.float32, True, False,
                                      "row-parallel"))  # fmt: skip
    assert _sent(model, plan=one)["plan"] != _sent(model, plan=two)["plan"]


def test_a_difference_in_a_long_list_is_named_by_its_entry() -> None:
    """A model's tensors are hundreds of entries: the message shows the first that differs
    (the parameter at fault), not every rank's whole list."""
    from boost_compiler.parallel.agreement import _shown

    tensors = [f"layers.{i}.w: [4, 4] float32 cpu" for i in range(300)]
    other = [*tensors[:7], "layers.7.w: [4, 8] float32 cpu", *tensors[8:]]
    shown = _shown([tensors, other])
    assert shown == ("entry 7 of 300: rank 0: layers.7.w: [4, 4] float32 cpu; "
                     "rank 1: layers.7.w: [4, 8] float32 cpu")  # fmt: skip
    assert "entry 300 of 301: rank 0: none (it has 300)" in _shown([tensors, [*tensors, "x"]])


def test_object_collectives_on_nccl_alone_use_the_ranks_own_device(monkeypatch) -> None:
    """A script that never set its CUDA device leaves every rank on device 0; on an
    NCCL-only group the agreement's object collective would then put every rank on one
    GPU. Under torchrun it runs on LOCAL_RANK's device instead (a CPU-serving group, a set
    device, or no torchrun: left as it is)."""
    import contextlib

    import torch

    from boost_compiler.parallel import agreement

    served = {"cpu": None}
    monkeypatch.setattr(agreement, "group_backend", lambda pg, dev: served[str(dev)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    current = {"index": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "device", lambda i: ("device", i))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert agreement._object_device(None) == ("device", 3)
    current["index"] = 2  # the script set one: kept
    assert isinstance(agreement._object_device(None), contextlib.nullcontext)
    current["index"] = 0
    served["cpu"] = "gloo"  # objects go through gloo on the CPU
    assert isinstance(agreement._object_device(None), contextlib.nullcontext)
    served["cpu"] = None
    monkeypatch.delenv("LOCAL_RANK")
    assert isinstance(agreement._object_device(None), contextlib.nullcontext)
