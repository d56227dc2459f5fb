"""The LM head split on the vocabulary with a sharded cross-entropy: exact at tp=2 (issue 15)."""

from __future__ import annotations

import math

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


# Cold Inductor compiles, one per check: the full tier (eager and dynamo cover the rules in
# CI; tests/test_seams.py lowers CoLA-LLaMA's vocabulary-parallel loss with Inductor).
SLOW = {
    "cola/inductor",
    "cola-tied/inductor",
    "step/sum/inductor",
    "hf/llama/inductor",
    "hf/qwen2/inductor",
}


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, CHECKS, slow=SLOW)


def _vocabulary_on_the_wire(wire: list, vocab: int, ids_shape: list, logits_out: bool) -> None:
    """No logits cross the wire, except one all-gather of the returned logits, forward.

    gloo records an all-gather's local input, so a gathered ``[b, s, V/p]`` shard shows
    as ``V/p`` wide: both widths count, and so does a flat payload of exactly the token
    count times ``V/p`` (logits flattened to 1-D keep neither width in their shape). A
    model that returns its logits (HF beside the loss, GPT-2 without one) gathers them
    once at the output, by design (the plan's decision); one that returns only the loss,
    never.
    """
    assert wire, "no collective ran: the check would see nothing"
    b, s = ids_shape
    blocks = {k * (vocab // 2) for k in (b * s, b * (s - 1))}  # all tokens, or shifted
    wide = [(name, back) for name, shape, _, back in wire
            if {vocab, vocab // 2} & set(shape) or math.prod(shape) in blocks]  # fmt: skip
    assert wide == ([("gloo:all_gather", False)] if logits_out else []), (wide, wire)


def _loss_on_the_wire(wire: list, ids_shape: list) -> None:
    """The loss's collectives: one all-gather of this rank's ``[N, 2]`` statistics (the
    online softmax's log-sum-exp and target term) forward, none backward.

    Its collectives are the per-token ones: a payload ``[N]`` or ``[N, k]`` over the
    ``N`` (shifted or not) tokens; the head's own gather is ``[b, s, d/p]``. Megatron's
    and torchtitan's ``loss_parallel`` run three (max, sum of exponentials, target).
    """
    b, s = ids_shape
    per_token = [(name, shape, back) for name, shape, _, back in wire
                 if len(shape) <= 2 and shape and shape[0] in (b * s, b * (s - 1))]  # fmt: skip
    assert len(per_token) == 1, (per_token, wire)
    name, shape, back = per_token[0]
    assert name == "gloo:all_gather" and shape[1:] == [2] and not back, per_token


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
    for r in ranks(res):
        _vocabulary_on_the_wire(
            r["wire"], r["vocab"], r["ids_shape"], key.startswith(("hf/", "gpt2"))
        )
        if not key.startswith("gpt2"):  # GPT-2's loss is outside the model: one device's
            _loss_on_the_wire(r["wire"], r["ids_shape"])
        if "tied" in key:  # the lookup's reduce-scatter (gloo runs it as an all-reduce of
            # the d-major [d, b, s] partial) and its backward all-gather of [b, s, d/p]
            b, s = r["ids_shape"]  # both tied models have d = 64
            assert ["gloo:all_reduce", [64, b, s], "float", False] in r["wire"], r["wire"]
            assert ["gloo:all_gather", [b, s, 32], "float", True] in r["wire"], r["wire"]


def _loss_graphs(smoothing: float) -> tuple[set[str], set[str]]:
    """The ops of the vocabulary-parallel loss's forward and backward graphs, compiled
    (AOTAutograd, as Inductor receives them) on a 2-rank fake group."""
    import torch
    from torch._dynamo.backends.common import aot_autograd

    from boost_compiler.tp.groups import fake_process_group
    from boost_compiler.tp.sharded_ops import vocab_parallel_cross_entropy

    graphs: list[set[str]] = []

    def record(gm, _inputs):  # type: ignore[no-untyped-def]
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    with fake_process_group(2, rank=1) as group:
        logits = torch.randn(12, 8, requires_grad=True)
        target = torch.tensor([0, 3, 8, 15, -100, 9, 7, 8, 1, 2, 14, 11])

        def loss(z: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(z, target, -100, "mean", smoothing, 16, 1, 2,
                                                group)  # fmt: skip

        torch._dynamo.reset()
        compiled = torch.compile(loss, backend=aot_autograd(fw_compiler=record,
                                                            bw_compiler=record))  # fmt: skip
        compiled(logits).backward()
    assert len(graphs) == 2, graphs
    return graphs[0], graphs[1]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_compiled_loss_reads_the_logits_element_wise(smoothing: float) -> None:
    """Compiled, the target's logit is picked by comparing columns with the target, so the
    backward is element-wise (one fused pass over ``[N, V/p]``): no gather forward, no
    scatter into a zeroed buffer backward (issue 45: that scatter made the backward on half
    the vocabulary slower than one process's on all of it). The forward's one collective is
    the ``[N, 2]`` statistics' all-gather; the backward has none."""
    fwd, bwd = _loss_graphs(smoothing)
    assert not [op for op in fwd | bwd if "gather.default" == op.split(".", 1)[-1]
                or "scatter" in op], (fwd, bwd)  # fmt: skip
    assert [op for op in fwd if "_c10d_functional" in op and "wait" not in op] == [
        "_c10d_functional.all_gather_into_tensor.default"
    ], fwd
    assert not [op for op in bwd if "_c10d_functional" in op], bwd
