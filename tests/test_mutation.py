"""In-place ops, aliases and views on sharded activations are exact at tp=2 (issue 13).

Every model of ``tests/mutation_checks.py`` runs through parallelize's own path
and through ``torch.compile(backend="boost", options={"lowering": "eager"})``;
the model holding every pattern also lowers with Inductor.
"""

from __future__ import annotations

import pytest

from tests.mutation_checks import MODELS
from tests.tp_harness import RTOL, run_world

CHECKS = [
    *[(f"{m}/eager", "tests.mutation_checks:exact_training", (m, None)) for m in MODELS],
    *[(f"{m}/dynamo", "tests.mutation_checks:exact_training", (m, "eager")) for m in MODELS],
    ("AllPatterns/inductor", "tests.mutation_checks:exact_training", ("AllPatterns", "inductor")),
    ("refuse", "tests.mutation_checks:refuses_parameter_write", ()),
]


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, CHECKS)


@pytest.mark.parametrize("key", [c[0] for c in CHECKS if c[0] != "refuse"])
def test_inplace_and_aliases_are_exact(two: dict, key: str) -> None:
    res = two[key]
    assert "error" not in res, res.get("error")
    for what in ("out", "loss", "grad", "param", "buffer"):
        assert res[what] <= RTOL, (key, what, res)
    assert res["fallbacks"] == 0, res  # every pattern stays on shards


def test_a_parameter_written_in_the_forward_is_refused_before_anything_changes(two: dict) -> None:
    res = two["refuse"]
    assert "error" not in res, res.get("error")
    assert res["error_type"] == "MutationError", res
    assert "blocks.0.up.weight" in res["message"] and "mutation_checks.py:" in res["message"], res
    assert res["unchanged"], res
