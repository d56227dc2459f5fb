"""Options that change the graph, compiled at tp=2 with per-block compilation: exact.

The seam that broke green: ``checkpoint`` under ``compile_blocks`` (on by default) no
longer compiled at tp=2, and its only multi-rank test was in the full tier. Each case
here is one compile of the 2-layer tiny CoLA-LLaMA on 2 ranks (one world for the
module), checked against the single-device model every step, with the backward
collectives counted on the wire (README, "Activation checkpointing": a 2-layer model
runs 9 backward collectives with or without low-rank checkpointing; whole-layer
recompute re-runs each layer's 4 forward ones).
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world

CASES = {
    "default": {},
    "checkpoint": {"checkpoint": True},
    "checkpoint_full": {"checkpoint": "full"},
}
#: Backward collectives beyond the default's: whole-layer recompute re-runs each of the
#: 2 layers' 4 forward all-reduces; low-rank checkpointing none.
EXTRA_BWD = {"checkpoint": 0, "checkpoint_full": 2 * 4}


@pytest.fixture(scope="module")
def world() -> dict:
    checks = [(k, "tests.seam_checks:compiled_with", (opts,)) for k, opts in CASES.items()]
    return run_world(2, checks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_option_is_exact_on_every_rank(world: dict, case: str) -> None:
    for r in ranks(result_of(world, case)):
        assert r["regions"] == 2, "parallelize kept the per-block route (two block regions)"
        assert r["loss_err"] <= RTOL, (r["rank"], r["losses"], r["ref_losses"])
        assert r["grad_err"] <= RTOL, (r["rank"], r["grad_worst"], r["grad_err"])
        assert r["param_err"] <= RTOL, (r["rank"], r["param_worst"], r["param_err"])
        assert max(r["out_err"]) <= RTOL, (r["rank"], r["out_err"])
        assert max(r["replica_drift"].values(), default=0.0) == 0.0, r["replica_drift"]


@pytest.mark.parametrize("case", sorted(EXTRA_BWD))
def test_backward_collectives_as_documented(world: dict, case: str) -> None:
    base = ranks(result_of(world, "default"))
    for r, b in zip(ranks(result_of(world, case)), base, strict=True):
        assert b["bwd_collectives"] == 4 * 2 + 2, "the layers' 4 each, 2 outside them"
        assert r["bwd_collectives"] == b["bwd_collectives"] + EXTRA_BWD[case], r["rank"]
