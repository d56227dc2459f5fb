"""Frozen base weights are split like the factors (issue 44, item 8): LoRA on a frozen Llama.

A loralib-style LoRA model (:mod:`tests.frozen_checks`) at tp=2 in one 2-process gloo
world, every rank asserted: exact against one device (losses, every LoRA gradient), the
frozen weights unchanged and without gradients, each rank holding at most 0.55 of one
device's parameter bytes, no fallback, and no more bytes on the wire per step than the
plan that keeps the frozen weights whole. The planner's memory term is checked on
structure alone (the fake process group): a frozen weight stays whole where splitting it
costs more per step than its bytes, and is split where its bytes dominate.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import boost_compiler
from boost_compiler.tp.groups import fake_process_group
from tests.tp_harness import RTOL, result_of, run_world

# key -> lora_training's (lowering, frozen weights forced whole, model, lr)
CHECKS = {
    "eager": (None, False),
    "compiled": ("eager", False),
    "whole": (None, True),  # the frozen weights forced replicated: the plan before
    "inductor": ("inductor", False),
    # HF's Llama with PEFT-style LoRA modules; lr 1e-3 as tests.tp_harness.compare_training_hf
    "peft_hf": (None, False, "peft_hf", 1e-3),
    # q/k/v as one frozen fused projection with its LoRA update: split per piece
    "fused_qkv": (None, False, "fused_qkv"),
}
SLOW = ["peft_hf", "inductor"]


@pytest.fixture(scope="module")
def two() -> dict:
    checks = [(key, "tests.frozen_checks:lora_training", args) for key, args in CHECKS.items()]
    return run_world(2, checks, slow=SLOW)


@pytest.mark.parametrize("how", ["eager", "compiled", "inductor", "peft_hf", "fused_qkv"])
def test_lora_on_frozen_llama_is_exact_with_frozen_weights_split(two: dict, how: str) -> None:
    res = result_of(two, how)
    assert res["fallbacks"] == [], res["fallbacks"]
    for rank in res["ranks"]:
        assert rank["loss_err"] <= RTOL and rank["grad_err"] <= RTOL, rank
        assert rank["param_err"] <= RTOL, rank["param_err"]
        assert rank["frozen_grads"] == [] and rank["frozen_changed"] == [], rank
        assert rank["state_dict_changed"] == [], rank["state_dict_changed"]
        # Every rank holds at most 0.55 of one device's parameter bytes.
        assert rank["bytes_ratio"] <= 0.55, (rank["bytes_ratio"], rank["replicated"])
    assert res["lora_trainable"] and all("lora_" in n for n in res["lora_trainable"])


def test_split_frozen_weights_send_no_more_than_whole_ones(two: dict) -> None:
    """Forward: gloo's events. Backward: the plan's collectives in ring bytes, since gloo runs
    a reduce-scatter (a split weight's input gradient) as an all-reduce of its whole input,
    which no ring implementation does; the plan's forward equals gloo's, checked here too."""
    split, whole = result_of(two, "eager"), result_of(two, "whole")
    for rank, rank_whole in zip(split["ranks"], whole["ranks"], strict=True):
        assert rank_whole["loss_err"] <= RTOL and rank_whole["grad_err"] <= RTOL
        assert rank_whole["bytes_ratio"] > 0.55  # the old plan: every base weight whole
        for r in (rank, rank_whole):
            assert r["ring"]["forward"] == r["wire_fwd"], r
        assert rank["wire_fwd"] <= rank_whole["wire_fwd"], (rank["wire_fwd"], rank_whole)
        assert rank["ring"]["backward"] <= rank_whole["ring"]["backward"], (rank, rank_whole)


class _Frozen(nn.Module):
    """One frozen ``n x n`` linear on a replicated input of ``tokens`` rows, trainable after."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.base = nn.Linear(n, n, bias=False).requires_grad_(False)
        self.head = nn.Linear(n, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x))


@pytest.mark.parametrize(("n", "split"), [(64, False), (1024, True)])
def test_the_planner_weighs_a_frozen_weights_memory(n: int, split: bool) -> None:
    """Whole, a 64 x 64 weight costs less than one collective's latency; a 1024 x 1024 one
    (4 MiB held on each rank) more than the output gathered for the split."""
    torch.manual_seed(0)
    model = _Frozen(n)
    with fake_process_group(2):
        boost_compiler.parallelize(model, torch.distributed.group.WORLD, (torch.randn(2, n),))
        plan = model.boost_plan
    assert plan.params["base.weight"].is_shard == split, (plan.params, plan.choices)
    [choice] = [c for c in plan.choices if "whole" in c.seconds]
    assert (choice.chosen != "whole") == split, str(choice)
    assert plan.fallbacks == []


def test_a_fused_frozen_base_is_split_per_piece_and_a_saved_plan_keeps_it(tmp_path) -> None:
    """q/k/v as one frozen projection plus its LoRA update, summed before the split: the base
    and ``lora_B`` split per piece (each rank its slice of q, of k and of v), no fallback; a
    plan saved so is forced as saved (plan_fit admits blocks on a frozen weight)."""
    import torch.distributed as dist

    from tests.frozen_checks import build

    with fake_process_group(2):
        model, ids = build("fused_qkv")
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
        path = model.boost_plan.save(tmp_path / "plan.json")
        again, _ = build("fused_qkv")
        boost_compiler.parallelize(again, dist.group.WORLD, (ids,), {"labels": ids}, plan=path)
    for m in (model, again):
        plan = m.boost_plan
        assert plan.fallbacks == [], plan.fallbacks
        for layer in range(2):
            for name in ("qkv.weight", "qkv.bias", "qkv.lora_B"):
                got = str(plan.params[f"blocks.{layer}.{name}"])
                assert got == "S(0, blocks=[256, 256, 256])", (name, got)
