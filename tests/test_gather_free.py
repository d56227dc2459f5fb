"""Patterns that gathered for no reason, now planned (issue 44): each as its authors write it.

One 2-process gloo world (:mod:`tests.gather_checks`), every rank asserted: each pattern in
a 2-layer LM is exact at tp=2 (eager, and compiled through dynamo's graphs with the
``"eager"`` lowering; Inductor in the full tier), plans no fallback, and puts no more
forward bytes per layer on the wire than the same model written the gather-free way. One
4-process world for key/value heads fewer than the ranks but more than one.
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world

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
    # Rotary on the halves of the one kv head: whole on every rank from its view, no gather.
    "mqa_halves": "mqa_gqa",
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


# Two key/value heads at tp=4 (1 < n_kv < p): no rank holds a whole head, so they are
# gathered unexpanded at their view (views._few_heads) and each rank's query head reads the
# one it uses; the bound is the same model through sdpa's enable_gqa.
FOUR = {"gqa2_repeat_kv": "gqa2", "gqa2_repeat_interleave": "gqa2"}


@pytest.fixture(scope="module")
def four() -> dict:
    checks = [
        (f"{n}/{how}", "tests.gather_checks:zoo", (n, lowering))
        for n in sorted({*FOUR, *FOUR.values()})
        for how, lowering in LOWERINGS.items()
    ]
    return run_world(4, checks, slow=[key for key, *_ in checks if key.endswith("/inductor")])


@pytest.mark.parametrize("how", list(LOWERINGS))
@pytest.mark.parametrize("name", [*FOUR, "gqa2"])
def test_fewer_kv_heads_than_ranks(four: dict, name: str, how: str) -> None:
    res, bound = result_of(four, f"{name}/{how}"), result_of(four, f"{FOUR.get(name, name)}/{how}")
    for rank, rank_bound in zip(ranks(res), ranks(bound), strict=True):
        assert rank["fallbacks"] == [], rank["fallbacks"]
        for what in ("loss_err", "grad_err", "param_err", "out_err"):
            assert rank[what] <= RTOL, (rank["rank"], what, rank[what])
        assert rank["bytes_per_layer"] <= rank_bound["bytes_per_layer"]


def test_a_computed_weight_with_a_broadcast_bias_runs_whole() -> None:
    """``F.linear(x, W, b)`` with ``W`` computed from parameters and ``b`` of another shape
    than ``[d_out]`` (F.linear broadcasts it): no row-parallel split, whose reduce-scatter
    would slice ``b`` as if it were one per output feature; the call runs whole (exact)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import boost_compiler
    from boost_compiler.tp.collectives import fake_process_group

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.a, self.b = nn.Parameter(torch.randn(32, 4)), nn.Parameter(torch.randn(4, 32))
            self.bias = nn.Parameter(torch.zeros(16, 1))  # one per token, broadcast

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return F.linear(self.emb(ids).flatten(0, 1), self.a @ self.b, self.bias).sum()

    with fake_process_group(2):
        model = Model()
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randint(0, 64, (2, 8)),))
        plan = model.boost_plan
    assert any("'linear'" in f for f in plan.fallbacks), plan.fallbacks
    assert not any("weight computed whole" in d for d in plan.decisions), plan.decisions


def test_complex_rotary_per_block_lowers_with_inductor() -> None:
    """Meta's rotary (``view_as_complex``) inside per-block regions: torch 2.13's backward of
    such a region has no Conjugate kernel (Inductor raised NotImplementedError compiling the
    backward), so the backend inlines the bodies and the step runs (the fake group: this is
    the lowering, the numbers are test_pattern_is_exact_...[gqa2/inductor]'s, full tier)."""
    import torch
    import torch.distributed as dist

    import boost_compiler
    from boost_compiler.backend import _holds_complex
    from boost_compiler.tp.collectives import fake_process_group
    from tests import gather_checks as G

    seen: list[bool] = []
    with fake_process_group(2):
        torch.manual_seed(0)
        model = G.TinyLM([G.LAYER["gqa2"]() for _ in range(G.LAYERS)])
        ids = torch.randint(0, G.V, (2, 16))
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,))
        assert model.boost_plan.route.startswith("per-block"), model.boost_plan.route
        torch._dynamo.reset()
        run = torch.compile(model, backend="boost")
        import boost_compiler.backend as backend

        original = backend._holds_complex
        backend._holds_complex = lambda gm: seen.append(original(gm)) or seen[-1]
        try:
            run(ids).sum().backward()
        finally:
            backend._holds_complex = original
    assert True in seen, "no region body was seen computing on complex tensors"
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not _holds_complex(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))


def test_dense_experts_go_on_ranks() -> None:
    """Dense experts (3-D weights read by ``bmm``, no bottleneck role) were held whole on
    every rank; the planner now weighs holding them against ``f`` on their input and puts
    ``E/p`` on each rank (``rules/expert_parallel.stacked_experts``; the numbers are
    ``test_pattern_is_exact_...[moe_repeat-*]``'s)."""
    import torch
    import torch.distributed as dist

    import boost_compiler
    from boost_compiler.tp.collectives import fake_process_group
    from tests import gather_checks as G

    with fake_process_group(2):
        model = G.TinyLM([G.LAYER["moe_repeat"]() for _ in range(G.LAYERS)])
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randint(0, 64, (2, 8)),))
        plan = model.boost_plan
    experts = {n: str(pl) for n, pl in plan.params.items() if n.endswith(("w_in", "w_out"))}
    assert set(experts.values()) == {"S(0)"} and len(experts) == 2 * G.LAYERS, experts
    for name, prm in model.named_parameters():
        if name in experts:
            assert prm.shape[0] == G.EXPERTS // 2, (name, prm.shape)
    assert any("experts on ranks" in d for d in plan.decisions), plan.decisions
