"""Patterns that gathered, now planned (issue 27, item 6): 0 fallbacks, exact at tp=2.

One 2-process gloo world (:mod:`tests.pattern_checks`), every rank asserted: a fused
q/k/v projection unbound per head (its heads stay split), multi-query attention (the
queries split on heads, the one shared key/value head gathered once and sliced to each
rank's heads), and ``x @ self.weight.T`` linears (split like ``F.linear``; before, the
transpose fixed the weight replicated on its way to the layer and the layer gathered).
"""

from __future__ import annotations

import pytest

from tests.pattern_checks import PATTERNS
from tests.tp_harness import RTOL, run_world


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, [(n, "tests.pattern_checks:pattern", (n,)) for n in PATTERNS])


# The bottleneck weights each pattern must split (a gathered block would also be exact).
SHARDED = {
    "head_major_qkv": {"blocks.0.qkv.up.weight", "blocks.1.o.down.weight"},
    "multi_query": {"blocks.0.qkv.up.weight", "blocks.1.o.down.weight"},
    "x_at_weight_t": {"blocks.0.down.weight", "blocks.0.up.weight", "blocks.2.up.weight"},
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_is_planned_with_no_fallback_and_exact(two: dict, name: str) -> None:
    res = two[name]
    assert "error" not in res, res["error"]
    assert res["fallbacks"] == [], res["fallbacks"]
    assert SHARDED[name] <= set(res["sharded"]), res["sharded"]
    for what in ("loss_err", "grad_err", "param_err", "out_err"):
        assert res[what] <= RTOL, (what, res[what])
    for rank in res["ranks"]:
        assert rank["fallbacks"] == [] and rank["grad_err"] <= RTOL
