"""The LM head split on the vocabulary with a sharded cross-entropy: exact at tp=2 (issue 15)."""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, run_world

CHECKS = [
    ("cola/eager", "tests.vocab_checks:cola_labels", (None,)),
    ("cola/dynamo", "tests.vocab_checks:cola_labels", ("eager",)),
    ("cola/inductor", "tests.vocab_checks:cola_labels", ("inductor",)),
    ("step/mean+smoothing", "tests.vocab_checks:user_train_step", ("mean", 0.1)),
    ("step/sum", "tests.vocab_checks:user_train_step", ("sum", 0.0)),
    ("hf/llama", "tests.vocab_checks:hf_padded", ("llama",)),
    ("hf/qwen2", "tests.vocab_checks:hf_padded", ("qwen2",)),
]


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, CHECKS)


@pytest.mark.parametrize("key", [c[0] for c in CHECKS])
def test_vocabulary_parallel_head_is_exact(two: dict, key: str) -> None:
    res = two[key]
    assert "error" not in res, res.get("error")
    for what in ("loss", "grad", "param"):
        assert res[what] <= RTOL, (key, what, res)
    assert res["head"] == "S(0)", res  # split on the vocabulary
    assert any("vocabulary-parallel head" in d for d in res["decisions"]), res
    assert res["fallbacks"] == [], res
