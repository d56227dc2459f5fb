"""The ranks of a tensor-parallel group end as one model, or all stop with a named error.

``parallelize`` broadcasts rank 0's parameters and buffers before cutting them, and
compares what cannot be made equal (tp/agreement.py). Each case runs on one 2-process
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
             "example_shapes_differ"]  # fmt: skip
    return run_world(2, [(n, f"tests.agreement_checks:{n}", ()) for n in names])


def test_ranks_built_from_other_seeds_train_rank_0s_model(world: dict) -> None:
    for r in ranks(result_of(world, "seeds_differ")):
        for tp, one in zip(r["tp"], r["rank0"], strict=True):
            assert abs(tp - one) <= RTOL * abs(one), (r["rank"], r["tp"], r["rank0"])
        assert r["param_err"] <= RTOL, (r["rank"], r["param_err"])


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("plan_files_differ", "differ in plan (rank 0: forced by plan="),
        ("batch_shapes_differ", "differ in input shapes"),
        ("example_shapes_differ", "differ in example inputs"),
    ],
)
def test_a_difference_is_refused_on_every_rank(world: dict, case: str, words: str) -> None:
    for r in ranks(result_of(world, case)):
        assert r["raised"] == "RankMismatchError", r
        assert words in r["message"] and "rank 0:" in r["message"] and "rank 1:" in r["message"]
        assert r["seconds"] < FAST_S, r
        assert not r.get("modified"), "a parameter was modified before the error"


def test_one_ranks_error_stops_every_rank(world: dict) -> None:
    r0, r1 = ranks(result_of(world, "one_rank_fails"))
    assert r1["raised"] == "UnknownOptionError", r1
    assert r0["raised"] == "PeerRankError" and "rank 1 of 2 failed" in r0["message"], r0
    assert "no_such_option" in r0["message"]
    assert max(r0["seconds"], r1["seconds"]) < FAST_S
