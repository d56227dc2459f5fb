"""The LM head split on the vocabulary with a sharded cross-entropy: exact at tp=2 (issue 15)."""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world

CHECKS = [
    ("cola/eager", "tests.vocab_checks:cola_labels", (None,)),
    ("cola/dynamo", "tests.vocab_checks:cola_labels", ("eager",)),
    ("cola/inductor", "tests.vocab_checks:cola_labels", ("inductor",)),
    ("cola-tied/eager", "tests.vocab_checks:cola_labels", (None, True)),
    ("cola-tied/inductor", "tests.vocab_checks:cola_labels", ("inductor", True)),
    ("gpt2-tied/logits", "tests.vocab_checks:gpt2_tied_logits", ()),
    ("step/mean+smoothing", "tests.vocab_checks:user_train_step", ("mean", 0.1)),
    ("step/sum", "tests.vocab_checks:user_train_step", ("sum", 0.0)),
    ("hf/llama", "tests.vocab_checks:hf_padded", ("llama",)),
    ("hf/qwen2", "tests.vocab_checks:hf_padded", ("qwen2",)),
    ("step/sum/inductor", "tests.vocab_checks:user_train_step", ("sum", 0.1, "inductor")),
    ("hf/llama/inductor", "tests.vocab_checks:hf_padded", ("llama", "inductor")),
    ("hf/qwen2/inductor", "tests.vocab_checks:hf_padded", ("qwen2", "inductor")),
]


# Cold Inductor compiles, one per check: the full tier (eager and dynamo cover the rules in CI).
SLOW = {"cola-tied/inductor", "step/sum/inductor", "hf/llama/inductor", "hf/qwen2/inductor"}


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, CHECKS, slow=SLOW)


@pytest.mark.parametrize("key", [c[0] for c in CHECKS])
def test_vocabulary_parallel_head_is_exact(two: dict, key: str) -> None:
    res = result_of(two, key)
    print(key, {what: f"{res[what]:.1e}" for what in ("loss", "grad", "param")})
    for what in ("loss", "grad", "param"):
        assert res[what] <= RTOL, (key, what, res)
    assert res["head"] == "S(0)", res  # split on the vocabulary
    tied = "tied embedding and head split on the vocabulary"
    said = tied if "tied" in key else "vocabulary-parallel head"
    assert any(said in d for d in res["decisions"]), res
    assert res["fallbacks"] == [], res
    for r in ranks(res) if "wire" in res else ():
        # what ran on the wire: no payload of the vocabulary's size, either way
        vocab = 512 if "tied" in key else 256
        assert all(vocab not in shape for _, shape, _, _ in r["wire"]), r["wire"]
        if "tied" in key:  # the lookup's reduce-scatter (gloo runs it as an all-reduce of
            # the d-major [d, b, s] partial) and its backward all-gather of [b, s, d/p]
            assert ["gloo:all_reduce", [64, 2, 32], "float", False] in r["wire"], r["wire"]
            assert ["gloo:all_gather", [2, 32, 32], "float", True] in r["wire"], r["wire"]
