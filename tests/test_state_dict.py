"""gather_state_dict / load_state_dict: TP=2 shards <-> single-device checkpoints, no loss.

One spawn of 2 gloo ranks runs every check (the tests/tp_harness.py pattern; the
checks live here because a spawned worker runs functions of its own module).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boost_compiler.parallel.state_dict import StateDictError, gather_state_dict, load_state_dict
from tests.extras import need

RTOL = 1e-5
WORLD = 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _sgd_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).backward()
    opt.step()


def roundtrip(*, rank: int, mesh: Any, tmp: str, tie: bool) -> dict[str, Any]:
    """parallelize, 1 SGD step, gather, load strict into a fresh model, compare outputs."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    model = build("tiny", seed=1, tie_embeddings=tie)
    ref = copy.deepcopy(model)
    (ids,) = example_inputs(model.cfg, batch=2, seq=16)
    boost_compiler.parallelize(model, mesh, (ids,))
    _sgd_step(model, ids)
    _sgd_step(ref, ids)  # the same step on one device, for the trained values
    sd = gather_state_dict(model)
    sd0 = gather_state_dict(model, rank0_only=True)
    fresh = build("tiny", seed=99, tie_embeddings=tie)  # other weights: the load must set all
    fresh.load_state_dict(sd, strict=True)
    out = model(ids)  # a collective: every rank calls it, whatever it does next
    res: dict[str, Any] = {
        "keys_match": list(sd) == list(ref.state_dict()),
        "shapes_match": all(sd[k].shape == v.shape for k, v in ref.state_dict().items()),
        "out_err": _rel(fresh(ids), out),
        "vs_single_device_step": max(_rel(sd[k], v) for k, v in ref.state_dict().items()),
        "rank0_only_keys": len(sd0),
        "rank0_only_equal": all(torch.equal(sd0[k], sd[k]) for k in sd0),
        "sharded": sum(p.is_shard for p in model.boost_plan.params.values()),
    }
    if rank == 0:  # files: torch.save (and safetensors when installed), weights_only loads
        files = {"torch": lambda path: torch.load(path, weights_only=True)}
        torch.save(sd0, os.path.join(tmp, "m.torch"))
        try:
            from safetensors.torch import load_file, save_file
        except ImportError:
            pass
        else:
            save_file(sd0, os.path.join(tmp, "m.safetensors"))
            files["safetensors"] = load_file
        for fmt, load in files.items():
            m = build("tiny", seed=7, tie_embeddings=tie)
            m.load_state_dict(load(os.path.join(tmp, f"m.{fmt}")), strict=True)
            res[f"file_err_{fmt}"] = _rel(m(ids), out)
    return res


def inverse(*, rank: int, mesh: Any, tmp: str) -> dict[str, Any]:
    """A single-device state dict loaded into a parallelized model: same loss."""
    import boost_compiler
    from examples.cola_llama import build, example_inputs

    single = build("tiny", seed=5)
    _sgd_step(single, example_inputs(single.cfg, seed=3)[0])  # not the init values
    full = single.state_dict()
    model = build("tiny", seed=11)
    (ids,) = example_inputs(model.cfg, batch=2, seq=16, seed=4)
    boost_compiler.parallelize(model, mesh, (ids,))
    before = model(ids, labels=ids).item()
    locals_before = {n: id(p) for n, p in model.named_parameters()}
    load_state_dict(model, full)
    loss, ref = model(ids, labels=ids).item(), single(ids, labels=ids).item()
    back = gather_state_dict(model)
    errors = {}
    bad = dict(full)
    bad["lm_head.weight"] = bad["lm_head.weight"][:, :-2]
    missing = {k: v for k, v in full.items() if k != "norm.weight"}
    for case, sd in {"shape": bad, "missing": missing}.items():
        try:
            load_state_dict(model, sd)
            errors[case] = "no error"
        except StateDictError as e:
            errors[case] = str(e)
    return {
        "loss_err": abs(loss - ref) / abs(ref),
        "loss": loss,
        "ref": ref,
        "changed": before != loss,
        "same_objects": locals_before == {n: id(p) for n, p in model.named_parameters()},
        "gather_back_exact": all(torch.equal(back[k], v) for k, v in full.items()),
        "errors": errors,
    }


def blocked(*, rank: int, mesh: Any, tmp: str) -> dict[str, Any]:
    """GPT-2 with fused q/k/v factors: blocked shards (a slice of q, k and v per rank)."""
    import boost_compiler
    from tests.models import make_gpt2_svd

    model, (ids,) = make_gpt2_svd(seed=3)
    single = copy.deepcopy(model)
    boost_compiler.parallelize(model, mesh, (ids,))
    plan = model.boost_plan
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids).float().pow(2).mean().backward()
    opt.step()
    sd = gather_state_dict(model)
    out = model(ids)
    fresh, _ = make_gpt2_svd(seed=8)
    fresh.load_state_dict(sd, strict=True)
    load_state_dict(model, single.state_dict())  # the inverse, on the blocked shards too
    return {
        "blocked": sorted(n for n, pl in plan.params.items() if pl.is_shard and pl.blocks),
        "out_err": _rel(fresh(ids), out),
        "inverse_err": _rel(model(ids), single(ids)),
    }


CHECKS = [
    ("untied", "roundtrip", {"tie": False}),
    ("tied", "roundtrip", {"tie": True}),
    ("inverse", "inverse", {}),
    ("blocked", "blocked", {}),
]


def _worker(rank: int, store: str, out: str, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results: dict[str, Any] = {}
    for key, fn, kw in CHECKS:
        torch.manual_seed(0)
        try:
            results[key] = globals()[fn](rank=rank, mesh=mesh, tmp=tmp, **kw)
        except Exception:  # reported to the test, which fails with the traceback
            results[key] = {"error": traceback.format_exc()}
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="boost-sd-")
    store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
    mp.spawn(_worker, args=(store, out, tmp), nprocs=WORLD, join=True)
    per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
    for r, res in enumerate(per_rank):
        for key, val in res.items():
            assert "error" not in val, f"rank {r} {key}: {val['error']}"
    return per_rank


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_gather_roundtrip(world: list[dict[str, Any]], variant: str) -> None:
    res = world[0][variant]
    print(variant, res)
    assert res["keys_match"] and res["shapes_match"]
    assert res["sharded"] > 0
    assert res["out_err"] <= RTOL
    assert res["file_err_torch"] <= RTOL
    # the gathered, TP-trained values are the single-device SGD step's values
    assert res["vs_single_device_step"] <= 1e-4
    assert res["rank0_only_equal"] and res["rank0_only_keys"] > 0
    assert world[1][variant]["rank0_only_keys"] == 0  # rank 1 keeps nothing


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_safetensors_file(world: list[dict[str, Any]], variant: str) -> None:
    need("safetensors")
    assert world[0][variant]["file_err_safetensors"] <= RTOL


def test_load_full_state_dict_into_parallel_model(world: list[dict[str, Any]]) -> None:
    for rank, per_rank in enumerate(world):
        res = per_rank["inverse"]
        print(rank, res)
        assert res["loss_err"] <= RTOL
        assert res["changed"]  # the load did change the model's weights
        assert res["same_objects"]  # optimizer/shadow keep their parameters
        assert res["gather_back_exact"]
        assert "lm_head.weight" in res["errors"]["shape"]
        assert "norm.weight" in res["errors"]["missing"]


def test_blocked_shards_fused_qkv(world: list[dict[str, Any]]) -> None:
    res = world[0]["blocked"]
    print(res)
    assert "h.0.attn.c_attn.up.weight" in res["blocked"]  # the case this test is for
    assert res["out_err"] <= RTOL
    assert res["inverse_err"] <= RTOL


def test_not_parallelized_raises() -> None:
    from examples.cola_llama import build

    model = build("tiny")
    with pytest.raises(StateDictError, match="not parallelized"):
        gather_state_dict(model)
    with pytest.raises(StateDictError, match="not parallelized"):
        load_state_dict(model, model.state_dict())
