"""Qwen3 and Phi-3 parallelize with no fallback and train exactly at tp=2 (issue 16)."""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, run_world

FAMILIES = {"qwen3": 14, "phi3": 8}  # bottlenecks in 2 layers (Phi-3: q/k/v and gate/up fused)


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, [(f, "tests.family_checks:hf_family", (f,)) for f in FAMILIES])


@pytest.mark.parametrize("family", FAMILIES)
def test_family_exact_without_fallback(two: dict, family: str) -> None:
    res = two[family]
    assert "error" not in res, res.get("error")
    assert res["fallbacks"] == [], res["fallbacks"]
    assert res["bottlenecks"] == FAMILIES[family], res
    for what in ("logits", "loss", "grad", "param"):
        assert res[what] <= RTOL, (what, res)
