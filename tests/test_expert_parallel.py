"""Expert parallelism at tp=2 (issue 44, item 9; ``tp/rules/expert_parallel.py``).

One 2-rank world. Qwen3-MoE and Mixtral from the zoo with the ``btp`` setting
``"expert_parallel"``, one training step against one device
(:func:`tests.moe_checks.experts_step`): exact on every rank (loss, every gathered gradient,
every parameter after an SGD step), no fallback, and every expert's weights on one rank
only, read off the tensors (rank 0's local ``gate_up_proj``/``down_proj`` equal one
device's experts 0-1, rank 1's experts 2-3). Each routed row is computed once: the ranks'
expert FLOPs add up to one device's. The collectives a step executes are the intermediate
split's, op for op and shape for shape (the same model without the setting, in the same
world): expert parallelism moves no more bytes, which is why the planner keeps the split
unless it cannot run split. Qwen3-MoE also through Inductor, and with the ``checkpoint``
pass; Mixtral in the full tier. Without the setting, the planner weighs it where ``p`` does not divide the
intermediate (:class:`tests.moe_checks.ExpertsProbe` with 255, where the whole experts'
weights cost more than one ``f``), and says so in the plan.
"""

from __future__ import annotations

import pytest

from tests.tp_harness import RTOL, ranks, result_of, run_world

EP = {"options": {"btp": "expert_parallel"}}
CHECKS = {
    "qwen3_moe/split": ("tests.moe_checks:experts_step", ("qwen3_moe",), {}),
    "qwen3_moe": ("tests.moe_checks:experts_step", ("qwen3_moe",), EP),
    "qwen3_moe/inductor": ("tests.moe_checks:experts_step", ("qwen3_moe",),
                           {**EP, "compiled": True}),
    "qwen3_moe/checkpoint": ("tests.moe_checks:experts_step", ("qwen3_moe",),
                             {"options": {"btp": "expert_parallel", "checkpoint": True},
                              "compiled": True}),
    "mixtral": ("tests.moe_checks:experts_step", ("mixtral",), EP),
    "probe/odd": ("tests.moe_checks:experts_probe", (True,), {"inner": 255}),
}  # fmt: skip
EP_RUNS = ("qwen3_moe", "qwen3_moe/inductor", "qwen3_moe/checkpoint", "mixtral")
E = 4  # experts per MoE layer in the zoo's configs


@pytest.fixture(scope="module")
def world() -> dict:
    # Mixtral runs transformers' same experts code as Qwen3-MoE, on a wider intermediate
    return run_world(2, [(k, fn, args, kw) for k, (fn, args, kw) in CHECKS.items()],
                     slow=["mixtral"])  # fmt: skip


@pytest.mark.parametrize("key", EP_RUNS)
def test_expert_parallel_is_exact(world: dict, key: str) -> None:
    r = result_of(world, key)
    for one in ranks(r):
        assert one["loss"] <= RTOL and one["grad"] <= RTOL and one["param"] <= RTOL, one
        assert one["fallbacks"] == []
    assert set(r["experts"].values()) == {"S(0)"}, r["experts"]
    assert len(r["decisions"]) == r["moe_layers"] and "(the btp setting)" in r["decisions"][0]


@pytest.mark.parametrize("key", EP_RUNS)
def test_every_expert_on_one_rank(world: dict, key: str) -> None:
    held = [one["held"] for one in ranks(result_of(world, key))]
    assert held[0].keys() == held[1].keys() and len(held[0]) == 2 * result_of(world, key)[
        "moe_layers"]  # fmt: skip
    for name in held[0]:
        assert held[0][name] == [0, 1] and held[1][name] == [2, 3], name


# (with the checkpoint pass the backward recomputes the forward's GEMMs: not counted)
@pytest.mark.parametrize("key", [k for k in EP_RUNS if k != "qwen3_moe/checkpoint"])
def test_each_routed_row_is_computed_once(world: dict, key: str) -> None:
    runs = ranks(result_of(world, key))
    assert sum(one["expert_flops"] for one in runs) == runs[0]["expert_flops_ref"]


def test_same_collectives_as_the_intermediate_split(world: dict) -> None:
    split = ranks(result_of(world, "qwen3_moe/split"))
    assert set(result_of(world, "qwen3_moe/split")["experts"].values()) != {"S(0)"}
    for mine, theirs in zip(ranks(result_of(world, "qwen3_moe")), split, strict=True):
        assert mine["ran"] == theirs["ran"]


def test_planner_takes_it_where_the_split_runs_whole(world: dict) -> None:
    r = result_of(world, "probe/odd")
    assert r["out"] <= RTOL and r["grad"] <= RTOL and r["fallbacks"] == []
    assert r["params"]["gate_up_proj"] == r["params"]["down_proj"] == "S(0)"
    assert len(r["decisions"]) == 1
    assert "tp=2 does not divide their intermediate 255; weighed against whole" in r["decisions"][0]


def test_a_saved_expert_parallel_plan_is_forced_as_saved(tmp_path) -> None:
    """The plan file keeps the experts on ranks: a fresh model given it plans them so,
    without the setting (the rule reads ``S(0)`` weights as expert-parallel)."""
    import torch.distributed as dist

    import boost_compiler
    from boost_compiler.tp.collectives import fake_process_group
    from tests.test_expert_alignment import Experts, _inputs

    with fake_process_group(2):
        model = Experts(32, 32)
        boost_compiler.parallelize(model, dist.group.WORLD, _inputs(32), options=EP["options"])
        path = model.boost_plan.save(tmp_path / "plan.json")
        again = Experts(32, 32)
        boost_compiler.parallelize(again, dist.group.WORLD, _inputs(32), plan=path)
    for m in (model, again):
        assert str(m.boost_plan.params["up"]) == str(m.boost_plan.params["down"]) == "S(0)"
        assert m.boost_plan.fallbacks == [] and [p.shape[0] for p in m.parameters()] == [2, 2]


@pytest.mark.parametrize("ends", [(5, 5, 14, 24), (0, 0, 9, 24), (7, 24, 24, 24)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_ranks_parts_add_up_to_the_block(dtype: str, ends: tuple[int, ...]) -> None:
    """:func:`expert_parallel_ffn` on one process, with ``torch._grouped_mm`` (which leaves
    the rows past the last end unwritten): over the ranks' experts, the parts sum to the
    block and their gradients to its gradients; an expert with no rows, a rank with none."""
    import torch
    import torch.nn.functional as F

    from boost_compiler.tp.sharded_ops import expert_parallel_ffn

    dt, g = getattr(torch, dtype), torch.Generator().manual_seed(0)
    rows, hidden, inner, p = 24, 16, 8, 2
    offs = torch.tensor(ends, dtype=torch.int32)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt).requires_grad_()

    x, w_up, w_down = leaf(rows, hidden), leaf(E, hidden, 2 * inner), leaf(E, inner, hidden)

    def ffn(x, w_up, w_down, offs):  # noqa: ANN001, ANN202 (a graph's signature)
        gate, up = torch._grouped_mm(x, w_up, offs=offs).chunk(2, -1)
        return torch._grouped_mm(F.silu(gate) * up, w_down, offs=offs)

    seed = torch.randn(rows, hidden, generator=g).to(dt)
    (ffn(x, w_up, w_down, offs) * seed).sum().backward()
    want = [t.grad.clone() for t in (x, w_up, w_down)]
    full = ffn(x, w_up, w_down, offs).detach()
    for t in (x, w_up, w_down):
        t.grad = None
    local = E // p
    parts = [
        expert_parallel_ffn(x, w_up[r * local : (r + 1) * local],
                            w_down[r * local : (r + 1) * local], offs, ffn, r * local)
        for r in range(p)
    ]  # fmt: skip
    (sum(parts) * seed).sum().backward()
    torch.testing.assert_close(sum(parts).detach(), full)
    for got, exp in zip((x.grad, w_up.grad, w_down.grad), want, strict=True):
        torch.testing.assert_close(got, exp)
