"""Pipeline parallelism with BTP inside each stage (issue 17): exact, and shards on the wire.

CPU, gloo, eager, the tiny CoLA-LLaMA with 2 layers per stage: with ``m`` micro-batches
the pipelined step (loss; parameters after 2 SGD steps, gathered to global shapes)
equals one device's step on the whole batch within fp32 1e-5 relative, and what crosses
a stage boundary is each tp rank's ``[b/m, s, d/tp]``, sent to the same tp rank of the
next stage. (2, 1, 2) and (2, 1, 1) always run; the dp > 1 layouts with
``BOOST_FULL_TESTS=1`` (more processes than the 2 CI cores take in a quick run).
"""

from __future__ import annotations

import os

import pytest

from boost_compiler.costmodel import pipeline_boundary_bytes
from boost_compiler.errors import PipelineError
from boost_compiler.train.pipeline import split_layers
from tests.tp_harness import RTOL, result_of, run_world

FN = "tests.pipeline_checks:pipelined_step"
FULL = os.environ.get("BOOST_FULL_TESTS") == "1"
FULL_REASON = "dp > 1 layouts start 4-8 processes on 2 cores; BOOST_FULL_TESTS=1 runs them"
D_MODEL = 64  # the tiny preset's hidden size


@pytest.fixture(scope="module")
def four() -> dict:
    checks: list[tuple] = [("pp2dp1tp2", FN, (2, 1, 2, 2))]
    if FULL:
        checks.append(("pp2dp2tp1", FN, (2, 2, 1, 2), {"batch": 8}))
    return run_world(4, checks)


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, [("pp2dp1tp1", FN, (2, 1, 1, 2)),
                         ("pp2dp1tp1/gpipe-adamw", FN, (2, 1, 1, 2),
                          {"schedule": "gpipe", "opt": "adamw"}),
                         ("train/pp2", "tests.pipeline_checks:trainer", (2, 2))])  # fmt: skip


def _check_exact(res: dict, pp: int, dp: int, tp: int, m: int, batch: int = 4) -> None:
    rks = res["ranks"]
    assert len(rks) == pp * dp * tp
    stages = {r["stage"] for r in rks}
    assert stages == set(range(pp))
    for r in rks:
        assert r["loss"] <= RTOL, r
        assert r["param"] <= RTOL, (r["worst_param"], r)
        assert r["moved"] > 1e-4, r  # the steps changed the parameters
    first = [r for r in rks if r["stage"] == 0]
    last = [r for r in rks if r["stage"] == pp - 1]
    assert all("embed.weight" in r["params"] for r in first)
    assert all({"lm_head.weight", "norm.weight"} <= set(r["params"]) for r in last)
    # What crosses the boundary: this tp rank's hidden shard, to the same tp rank.
    shard = [batch // dp // m, 16, D_MODEL // tp]
    for r in rks:
        assert r["boundary_shape"] == shard
        assert r["boundary_bytes"] == shard[0] * shard[1] * shard[2] * 4
        assert len(r["sends"]) == 2 * m  # m activations (or m gradients) per step, 2 steps
        peer_stage = 1 if r["stage"] == 0 else 0
        (peer,) = [q for q in rks if q["stage"] == peer_stage and q["tp_rank"] == r["tp_rank"]
                   and q["dp_rank"] == r["dp_rank"]]  # fmt: skip
        for shape, nbytes, dst in r["sends"]:
            assert shape == shard and nbytes == r["boundary_bytes"], r["sends"]
            assert dst == peer["global_rank"], (r, peer)


def test_pp2_tp2_is_exact_and_sends_shards(four: dict) -> None:
    res = result_of(four, "pp2dp1tp2")
    _check_exact(res, 2, 1, 2, 2)
    full_bytes = 2 * 16 * D_MODEL * 4
    print("pp=2 tp=2: bytes per micro-batch across the boundary, per tp rank:",
          res["boundary_bytes"], f"(full hidden {full_bytes})")  # fmt: skip
    assert res["boundary_bytes"] * 2 == full_bytes
    # the cost model's figure is the measured one
    model = pipeline_boundary_bytes(4, 16, D_MODEL, 2, 2)
    assert (model.p2p, model.tp_gather) == (res["boundary_bytes"], full_bytes)


def test_pp2_tp1_is_exact(two: dict) -> None:
    _check_exact(result_of(two, "pp2dp1tp1"), 2, 1, 1, 2)


def test_pp2_gpipe_adamw_is_exact(two: dict) -> None:
    _check_exact(result_of(two, "pp2dp1tp1/gpipe-adamw"), 2, 1, 1, 2)


def test_trainer_pp_path_matches_one_process(two: dict) -> None:
    """``train(pp=2, microbatches=2)``: losses and clipped-norm inputs equal tp=pp=1's."""
    from boost_compiler.train import TrainConfig, train
    from tests.pipeline_checks import TRAIN

    res = result_of(two, "train/pp2")
    want = train(TrainConfig(**TRAIN, compile=False, progress=False))
    for r in res["ranks"]:
        got = {int(k): v for k, v in r["losses"].items()}
        norms = {int(k): v for k, v in r["grad_norms"].items()}
        assert sorted(got) == [0, 1, 2]
        for s in got:
            assert abs(got[s] - want.losses[s]) <= 1e-5 * abs(want.losses[s]), (got, want.losses)
            assert abs(norms[s] - want.grad_norms[s]) <= 1e-5 * want.grad_norms[s]
    assert want.grad_norms[0] > 0.5  # clipping was active


@pytest.mark.skipif(not FULL, reason=FULL_REASON)
def test_pp2_dp2_is_exact(four: dict) -> None:
    _check_exact(result_of(four, "pp2dp2tp1"), 2, 2, 1, 2, batch=8)


@pytest.mark.skipif(not FULL, reason=FULL_REASON)
def test_pp2_dp2_tp2_is_exact() -> None:
    res = result_of(run_world(8, [("pp2dp2tp2", FN, (2, 2, 2, 2), {"batch": 8})]), "pp2dp2tp2")
    _check_exact(res, 2, 2, 2, 2, batch=8)


def test_cost_model_boundary_bytes() -> None:
    assert pipeline_boundary_bytes(8, 4096, 4096, 4, 4, 2).p2p == 2 * 4096 * 1024 * 2
    assert pipeline_boundary_bytes(4, 16, 64, 1, 2).tp_gather == 0  # no tp: nothing to gather
    with pytest.raises(ValueError, match="divide"):
        pipeline_boundary_bytes(3, 16, 64, 2, 2)


def test_split_layers() -> None:
    assert [s.layers for s in split_layers(4, 2)] == [(0, 1), (2, 3)]
    # the extra layers go to the middle stages first (the ends hold embedding / head)
    assert [len(s.layers) for s in split_layers(4, 3)] == [1, 2, 1]
    assert [len(s.layers) for s in split_layers(5, 3)] == [2, 2, 1]
    assert [s.layers for s in split_layers(3, 2, [1, 2])] == [(0,), (1, 2)]
    assert split_layers(3, 2)[1].last and split_layers(3, 2)[0].first
    with pytest.raises(PipelineError, match="summing to 3"):
        split_layers(3, 2, [1, 1])
    with pytest.raises(PipelineError, match="middle stage"):
        split_layers(2, 3, [1, 0, 1])
