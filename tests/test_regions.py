"""Checkpoint regions, a second parallelize, and meta-device models at tp=2 (issue 13)."""

from __future__ import annotations

import pytest
import torch

from tests.extras import need, need_kernels
from tests.tp_harness import RTOL, run_world

CHECKS = [
    ("twice", "tests.region_checks:parallelize_twice", ()),
    ("meta", "tests.region_checks:meta_device", ()),
    ("meta_reset", "tests.region_checks:meta_reset_parameters", ()),
    ("hf_checkpointing", "tests.region_checks:hf_gradient_checkpointing", ()),
]


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, CHECKS)


def test_hf_gradient_checkpointing_is_parallelized_exactly(two: dict) -> None:
    res = two["hf_checkpointing"]
    assert "error" not in res, res.get("error")
    plain, ck = res["plain"], res["checkpointed"]
    for r in (plain, ck):
        for what in ("logits", "loss", "grad", "param"):
            assert r[what] <= RTOL, (what, res)
        assert r["fallbacks"] == [], res
    assert ck["bottlenecks"] == plain["bottlenecks"] == 14, res  # 7 per layer, 2 layers
    assert ck["forward_collectives"] == plain["forward_collectives"] > 0, res


def test_hf_gradient_checkpointing_with_kernels_is_parallelized(two: dict) -> None:
    """With ``kernels`` installed (transformers 5.25 depends on it) HF's attention forwards
    set a ContextVar inside the checkpoint region, which dynamo refuses by default; the
    parallelized forward traces with boost's dynamo settings (_dynamo_compat.py)."""
    need_kernels()
    res = two["hf_checkpointing"]
    assert "error" not in res, res.get("error")
    assert res["kernelized"] > 0, res  # the side-effecting wrapper was in the traced model
    assert res["checkpointed"]["fallbacks"] == [] and res["checkpointed"]["grad"] <= RTOL, res


def test_checkpointed_hf_model_with_kernels_is_captured() -> None:
    """parallelize's capture of a gradient-checkpointed HF Llama whose forwards carry the
    ``kernels`` wrapper: one graph, every frame compiled; the dynamo setting it needs is
    set only for the capture (the process keeps dynamo's default)."""
    need("transformers")
    need_kernels()
    from boost_compiler.ir.capture import capture
    from tests.models import make_hf

    model, (ids,) = make_hf(seed=0, family="llama")
    model.gradient_checkpointing_enable()
    model.train()
    assert any("_kernel_funcs" in m.__dict__ for m in model.modules())  # the wrapper is in play
    before = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    graphs = capture(model, (ids,), {"labels": ids, "use_cache": False}, require_compiled=True)
    assert len(graphs) == 1
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint == before


def test_parallelize_twice_raises_and_changes_nothing(two: dict) -> None:
    res = two["twice"]
    assert "error" not in res, res.get("error")
    assert res["model"] and "already parallelized" in res["model"], res
    assert res["submodule"] and "already a tensor-parallel shard" in res["submodule"], res
    assert res["unchanged"], res


def test_meta_device_model_materialised_from_a_full_state_dict_trains_exactly(two: dict) -> None:
    res = two["meta"]
    assert "error" not in res, res.get("error")
    assert res["all_meta"], res  # parallelize allocated nothing
    assert res["local_bytes"] == res["expected_bytes"], res  # 1/p of the model's bytes
    assert res["loss"] <= RTOL and res["grad"] <= RTOL, res


def test_meta_device_model_reset_like_one_device(two: dict) -> None:
    res = two["meta_reset"]
    assert "error" not in res, res.get("error")
    assert res["reset"] == 7, res  # 3 blocks x 2 linears + the head
    assert res["init_err"] == 0.0 and res["out_err"] <= RTOL, res
