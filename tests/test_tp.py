"""Bottleneck-aware TP on 2 and 4 CPU processes (gloo): exact against one device."""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, run_world

MODELS = ["make_cola_llama", "make_cola_ref_layout", "make_gpt2_svd", "make_gqa_cola"]
TWO = [(f"{m}/eager", "compare_training", (m, False)) for m in MODELS] + [
    ("make_cola_llama/compiled", "compare_training", ("make_cola_llama", True)),
    ("shapes", "other_shapes_and_kwargs", ()),
    ("memory", "param_memory", ()),
]
# GQA's 2 kv heads do not divide over 4 ranks; the others do.
FOUR = [(f"{m}/eager", "compare_training", (m, False)) for m in MODELS[:3]] + [
    ("memory", "param_memory", ()),
]


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, [(k, f, (*a,)) for k, f, a in TWO])


@pytest.fixture(scope="module")
def four() -> dict:
    return run_world(4, [(k, f, (*a,)) for k, f, a in FOUR])


def _check_exact(res: dict) -> None:
    assert "error" not in res, res.get("error")
    print(f"losses {res['losses']} ref {res['ref_losses']} grad rel err {res['grad_err']:.2e}")
    assert res["loss_err"] <= RTOL
    assert res["grad_err"] <= RTOL
    assert res["losses"][0] != res["losses"][-1]  # it trained


@pytest.mark.parametrize("key", [k for k, *_ in TWO if "/" in k])
def test_exact_on_2_ranks(two: dict, key: str) -> None:
    _check_exact(two[key])


@pytest.mark.parametrize("key", [k for k, *_ in FOUR if "/" in k])
def test_exact_on_4_ranks(four: dict, key: str) -> None:
    _check_exact(four[key])


def test_llama_needs_no_fallback(two: dict) -> None:
    assert two["make_cola_llama/eager"]["fallbacks"] == []
    assert two["make_gqa_cola/eager"]["fallbacks"] == []


def test_other_batch_seq_kwargs_and_eval(two: dict) -> None:
    res = two["shapes"]
    assert "error" not in res, res.get("error")
    print(res)
    assert all(err <= RTOL for err in res.values()), res


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_parameter_memory(two: dict, four: dict, world: int) -> None:
    res = (two if world == 2 else four)["memory"]
    assert "error" not in res, res.get("error")
    bound = res["sharded"] / world + res["replicated"]
    print(f"p={world}: {res['local']:,} bytes per rank of {res['total']:,} (bound {bound:,.0f})")
    assert res["local"] <= bound
    assert res["sharded"] > 0.5 * res["total"]
