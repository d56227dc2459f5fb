"""Options that change the graph, compiled at tp=2 with per-block compilation: exact.

The seam that broke green: ``checkpoint`` under ``compile_blocks`` (on by default) no
longer compiled at tp=2, and its only multi-rank test was in the full tier. Each case
here is one compile of the 2-layer tiny CoLA-LLaMA on 2 ranks (one world for the
module) with one option that changes the graph, checked against the single-device
model every step; the checkpoint modes' backward collectives are counted on the wire
(docs/how-it-works.md, "The passes").
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world

CASES = {
    "checkpoint": {"checkpoint": True},
    "checkpoint_full": {"checkpoint": "full"},
    "online_norm_off": {"online_norm": False},
    "group_linears_off": {"group_linears": False},
    "overlap_comm_off": {"overlap_comm": False},  # on by default here (gloo: "auto")
    "compile_blocks_off": {"compile_blocks": False},
}
#: Backward collectives of the 2-layer model with the default passes: each layer's 4 (3r,
#: r, 2r, r) and 2 outside the layers; low-rank checkpointing adds none, whole-layer
#: recompute re-runs each layer's 4 forward all-reduces.
BWD = {"checkpoint": 4 * 2 + 2, "checkpoint_full": 4 * 2 + 2 + 2 * 4}


@pytest.fixture(scope="module")
def world() -> dict:
    checks = [(k, "tests.seam_checks:compiled_with", (opts,)) for k, opts in CASES.items()]
    return run_world(2, checks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_option_is_exact_on_every_rank(world: dict, case: str) -> None:
    blocks = 0 if CASES[case].get("compile_blocks") is False else 2
    for r in ranks(result_of(world, case)):
        assert r["regions"] == blocks, "the route parallelize was asked for (block regions)"
        assert r["loss_err"] <= RTOL, (r["rank"], r["losses"], r["ref_losses"])
        assert r["grad_err"] <= RTOL, (r["rank"], r["grad_worst"], r["grad_err"])
        assert r["param_err"] <= RTOL, (r["rank"], r["param_worst"], r["param_err"])
        assert max(r["out_err"]) <= RTOL, (r["rank"], r["out_err"])
        assert max(r["replica_drift"].values(), default=0.0) == 0.0, r["replica_drift"]


@pytest.mark.parametrize("case", sorted(BWD))
def test_backward_collectives_as_documented(world: dict, case: str) -> None:
    for r in ranks(result_of(world, case)):
        assert r["bwd_collectives"] == BWD[case], (r["rank"], r["bwd_collectives"])
