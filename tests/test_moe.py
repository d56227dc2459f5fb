"""MoE experts in parallel at tp=2 (issue 30, item 2; docs/moe.md).

One 2-rank world. For each MoE family of the zoo (Mixtral, Qwen3-MoE, DeepSeek-V3), one
training step against one device (:func:`tests.moe_checks.experts_step`): exact (loss,
every gathered gradient, every gathered parameter after an SGD step, on every rank), no
fallback, both expert weights of every MoE layer split (``gate_up_proj`` on its fused
gate/up rows per block, ``down_proj`` on its intermediate), and each rank's expert FLOPs
over the step at most 0.55 of one device's (exactly half: every rank runs every expert
on every routed token, over its half of the intermediate). Qwen3-MoE runs in the default
tier; Mixtral and DeepSeek-V3 with ``BOOST_FULL_TESTS=1`` (tests/test_zoo.py checks all
three for exactness over 3 steps in the default tier).
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world
from tests.zoo_checks import MOE

CI = "qwen3_moe"
MAX_RATIO = 0.55
# gate_up_proj [E, 2I, H] split per block on its 2I rows; down_proj [E, H, I] on I.
GATE_UP = {"mixtral": "S(1, blocks=[172, 172])", "qwen3_moe": "S(1, blocks=[32, 32])",
           "deepseek_v3": "S(1, blocks=[32, 32])"}  # fmt: skip
# The zoo's batch: N = 2 x 16 tokens, hidden H = 64, top-k 2 (all three families).
N, H, K = 32, 64, 2
# tests.moe_checks.ExpertsProbe: experts [4, 2 x 8, 16] and [4, 16, 8], 16 tokens, top-2.
# routed: the router gathers the hidden; the up GEMM is column-parallel (its fused gate/up
# rows per block), the down GEMM row-parallel, its partial output reduce-scattered after
# the top-k sum, the experts' input gradient summed on the gathered [N, H].
# fixed: the dispatch picks rows of the hidden shard; the up GEMM is row-parallel (split
# on the hidden), the down GEMM column-parallel (its hidden rows), one all-reduce of the
# [N k, 2 I] intermediate.
PROBES = {
    "routed": ({"gate_up_proj": "S(1, blocks=[8, 8])", "down_proj": "S(2)"},
               [["reduce_scatter", [2, 8, 16], "forward", "partial onto the shard"],
                ["all_reduce", [16, 16], "backward", "f"]]),
    "fixed": ({"gate_up_proj": "S(2)", "down_proj": "S(1)"},
              [["all_reduce", [32, 16], "forward", "experts row-parallel"],
               ["all_reduce", [32, 8], "backward", "f"]]),
}  # fmt: skip


@pytest.fixture(scope="module")
def world() -> dict:
    checks = [(f, "tests.moe_checks:experts_step", (f,)) for f in MOE]
    checks += [(f"probe/{k}", "tests.moe_checks:experts_probe", (k == "routed",)) for k in PROBES]
    checks += [("bf16", "tests.moe_checks:experts_bf16_step", ())]
    checks += [("factored", "tests.moe_lowrank_checks:factored_step", (CI, "cola"))]
    return run_world(2, checks, slow=[f for f in MOE if f != CI])


@pytest.mark.parametrize("family", MOE)
def test_experts_split_exactly(world: dict, family: str) -> None:
    res = result_of(world, family)
    for rank in ranks(res):
        assert rank["loss"] <= RTOL and rank["grad"] <= RTOL and rank["param"] <= RTOL, rank
        assert rank["fallbacks"] == [], rank["fallbacks"]
    experts = res["experts"]
    assert len(experts) == 2 * res["moe_layers"] > 0, experts
    for name, pl in experts.items():
        want = GATE_UP[family] if name.endswith("gate_up_proj") else "S(2)"
        assert pl == want, (name, pl)


@pytest.mark.parametrize("family", MOE)
def test_expert_flops_per_rank(world: dict, family: str) -> None:
    """One step's expert GEMM FLOPs (``torch.utils.flop_counter``'s formulas on the matmuls
    the profiler saw inside the grouped GEMM kernels): each rank's against one device's."""
    res = result_of(world, family)
    for rank in ranks(res):
        assert rank["expert_flops_ref"] > 0, rank
        assert rank["expert_ratio"] <= MAX_RATIO, (rank["expert_ratio"], rank)
        assert rank["gemm_ratio"] < 1, rank  # every GEMM of the step, together


@pytest.mark.parametrize("family", MOE)
def test_expert_collectives(world: dict, family: str) -> None:
    """What each MoE layer communicates, as planned (gloo runs a reduce-scatter as an
    all-reduce): forward, the router's gathered hidden ``[N, H]`` and the experts' output,
    summed over the top-k while still partial, reduce-scattered onto the residual's shard
    ``[b, s, H]``; backward, that scatter's all-gather, the experts' input gradient summed
    over ``[N, H]`` (``f`` on the gathered hidden, not on the ``k``-times larger
    dispatched rows) and the routing weights' ``[N k, 1]``. No collective carries the
    ``[N k, H]`` rows the experts compute on."""
    res = result_of(world, family)
    layers, planned = res["moe_layers"], res["planned"]

    def count(kind: str, shape: list[int], direction: str, reason: str | None = None) -> int:
        return sum(c[:3] == [kind, shape, direction] and reason in (None, c[3]) for c in planned)

    assert count("all_gather", [N, H], "forward") == layers, planned  # the router's input
    assert count("reduce_scatter", [2, 16, H], "forward", "partial onto the shard") == layers
    assert count("all_gather", [2, 16, H], "backward", "partial onto the shard") == layers
    assert count("all_reduce", [N, H], "backward", "f") == layers, planned
    assert count("all_reduce", [N * K, 1], "backward", "f") == layers, planned
    rows = [c for c in planned if c[1] in ([N * K, H], [N, K, H])]
    assert rows == [], rows


@pytest.mark.parametrize("probe", PROBES)
def test_both_splits_of_the_grouped_gemm(world: dict, probe: str) -> None:
    """Column- then row-parallel from a gathered hidden, row- then column-parallel from a
    hidden shard: exact on every rank, no fallback, the experts split as expected."""
    res = result_of(world, f"probe/{probe}")
    params, expert_collectives = PROBES[probe]
    for rank in ranks(res):
        assert rank["out"] <= RTOL and rank["grad"] <= RTOL, rank
        assert rank["fallbacks"] == [], rank["fallbacks"]
    assert {n: res["params"][n] for n in params} == params, res["params"]
    for c in expert_collectives:
        assert c in res["planned"], res["planned"]


# bf16 against fp32: a parallel bf16 run must be as accurate as one device's bf16 run.
# Both round the same fp32 computation at different places (tp=2 sums its partial
# products after rounding them, the online norm scales after its GEMM), so neither is
# closer to the other than to fp32: each quantity's error against fp32 at tp=2 is
# bounded by BF16_NOISE times the worst one-device bf16 error over the logits and every
# gradient (measured on Qwen3-MoE: one device 0.044 (a k_proj down factor's gradient),
# tp=2 0.113 on the same gradient, 2.5x; 1.44x with online_norm off). A wrong split is
# O(1): a gradient summed twice is off by 1.0, an expert's half intermediate lost by 0.5.
# The loss is a mean over tokens and its error far smaller (measured 8e-5 at tp=2):
# within one bf16 rounding, 2^-8.
BF16_NOISE = 4.0


def test_bf16_experts_parallelize_and_train(world: dict) -> None:
    """bf16 Qwen3-MoE at tp=2 (``torch._grouped_mm``, whose fake kernel refused the
    placeholders' stride-0 weights before ``Placeholder.__tensor_unflatten__`` gave them a
    parameter's strides): one step against one device, on every rank, no fallback."""
    from tests.moe_checks import BF16_U

    res = result_of(world, "bf16")
    for rank in ranks(res):
        assert rank["fallbacks"] == [], rank["fallbacks"]
        routing = rank["routing"]
        assert routing["tp"] == routing["one"] == routing["fp32"], rank["margin"]
        one, tp = rank["one"], rank["tp"]
        noise = max(v for n, v in one.items() if not n.startswith("loss"))
        assert 0 < noise < 0.1, one  # bf16's own error: present, and of bf16's size
        for name, err in tp.items():
            bound = BF16_U if name.startswith("loss") else BF16_NOISE * noise
            assert err <= bound, (name, err, bound, one[name])
    assert set(res["experts"].values()) == {"S(1, blocks=[32, 32])", "S(2)"}, res["experts"]


# to_low_rank(experts=True) at rank 16 per expert (tests.moe_lowrank_checks), split the
# BTP way: each pair's down factor row-parallel (the gathered rows sliced on H, the
# intermediate on I), its up factor column-parallel (gate/up per block; down on H).
FACTORED = {"gate_up_proj_down": "S(2)", "gate_up_proj_up": "S(1, blocks=[32, 32])",
            "down_proj_down": "S(2)", "down_proj_up": "S(1)"}  # fmt: skip
RANK = 16


def test_factored_experts_split_exactly(world: dict) -> None:
    """Routed experts factored per expert (CoLA, SiLU between the factors): one step at
    tp=2 against one device, exact on every rank (loss, every gathered gradient, every
    gathered parameter after SGD), no fallback, every factor split; forward, each MoE
    layer all-reduces only its two ``[N k, r]`` latents (besides the router's gather):
    no ``[N k, 2I]`` or ``[N k, H]`` rows, no reduce-scatter at the residual."""
    res = result_of(world, "factored")
    for rank in ranks(res):
        assert rank["loss"] <= RTOL and rank["grad"] <= RTOL and rank["param"] <= RTOL, rank
        assert rank["fallbacks"] == [], rank["fallbacks"]
        assert len(rank["expert_grads"]) == 8, rank["expert_grads"]
    for name, pl in res["experts"].items():
        assert pl == FACTORED[name.rpartition(".")[2]], (name, pl)
    forward = [c for c in res["planned"] if c[2] == "forward"]
    latents = [c for c in forward if c[:2] == ["all_reduce", [N * K, RANK]]]
    assert len(latents) == 2 * 2, forward  # two pairs in each of the two MoE layers
    assert not [c for c in forward if c[1] in ([N * K, H], [2, 16, H]) and
                c[0] in ("all_reduce", "reduce_scatter")], forward  # fmt: skip
