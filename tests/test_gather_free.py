"""Patterns that gathered for no reason, now planned (issue 44): each as its authors write it.

One 2-process gloo world (:mod:`tests.gather_checks`), every rank asserted: each pattern in
a 2-layer LM is exact at tp=2 (eager, and compiled through dynamo's graphs with the
``"eager"`` lowering; Inductor in the full tier), plans no fallback, and puts no more
forward bytes per layer on the wire than the same model written the gather-free way.
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, result_of, run_world

# pattern -> the same model written the gather-free way.
PAIRS = {
    "square": "pow2",
    "torch_square": "pow2",
    "view_as": "view",
    "mT": "transpose",
    "rope_slice_mqa": "rope_whole_mqa",
    # One kv head (n_kv < p) repeated to every query head, against attention reading the
    # unexpanded head (sdpa's enable_gqa): the bound is gathering that head, not its copies.
    "mqa_expand": "mqa_gqa",
    "mqa_repeat_interleave": "mqa_gqa",
    "mqa_repeat_kv": "mqa_gqa",
    "gqa2_repeat_kv": "gqa2",
    "moe_repeat": "moe_expand",
    "lora_merged": "lora_apart",
}
NAMES = sorted({*PAIRS, *PAIRS.values()})
LOWERINGS = {"eager": None, "compiled": "eager", "inductor": "inductor"}


@pytest.fixture(scope="module")
def two() -> dict:
    checks = [
        (f"{n}/{how}", "tests.gather_checks:zoo", (n, lowering))
        for n in NAMES
        for how, lowering in LOWERINGS.items()
    ]
    slow = [key for key, *_ in checks if key.endswith("/inductor")]
    return run_world(2, checks, slow=slow)


@pytest.mark.parametrize("how", list(LOWERINGS))
@pytest.mark.parametrize("name", list(PAIRS))
def test_pattern_is_exact_with_no_fallback_and_no_more_bytes(
    two: dict, name: str, how: str
) -> None:
    res, free = result_of(two, f"{name}/{how}"), result_of(two, f"{PAIRS[name]}/{how}")
    assert res["fallbacks"] == [], res["fallbacks"]
    for what in ("loss_err", "grad_err", "param_err", "out_err"):
        assert res[what] <= RTOL, (what, res[what])
    for rank, rank_free in zip(res["ranks"], free["ranks"], strict=True):
        assert rank["fallbacks"] == [] and rank["grad_err"] <= RTOL
        assert rank["bytes_per_layer"] <= rank_free["bytes_per_layer"], (
            rank["wire_fwd"],
            rank_free["wire_fwd"],
        )
