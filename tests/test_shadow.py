"""The shadow contract: what ``parallelize`` leaves on a model, and what its ``nn.Module`` methods do.

Structure on torch's fake process group (one process: no numbers); the numbers of a
converted parallel model against the single-device model converted the same way on 2
gloo ranks (:func:`converted_matches_single_device`, run by :func:`run_world`).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import boost_compiler
from boost_compiler.models.cola_llama import build, example_inputs
from boost_compiler.parallel.shadow import (
    ATTR,
    ParallelState,
    is_shard,
    parallel_state,
    shadow_param,
)
from boost_compiler.tp.collectives import fake_process_group
from tests.tp_harness import RTOL, _gathered_grad, _rel, ranks, result_of, run_world

HOOK_METHODS = [
    ("register_forward_hook", lambda m, i, o: None),
    ("register_forward_pre_hook", lambda m, i: None),
    ("register_full_backward_hook", lambda m, gi, go: None),
    ("register_full_backward_pre_hook", lambda m, go: None),
    ("register_backward_hook", lambda m, gi, go: None),
]


def _parallel(world: int = 2, **overrides: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    model = build("tiny", **overrides)
    ids = example_inputs(model.cfg, seq=16)
    boost_compiler.parallelize(model, dist.group.WORLD, ids)
    return model, ids


def _shadow_params(state: ParallelState) -> dict[str, torch.nn.Parameter]:
    return dict(state.shadow.named_parameters())


def _agree(model: torch.nn.Module) -> None:
    """Each placeholder has its shard's dtype, device and requires_grad; each mode matches."""
    state = parallel_state(model)
    assert state is not None
    placeholders = _shadow_params(state)
    for name, local in model.named_parameters():
        ph = placeholders[name]
        assert (ph.dtype, ph.device, ph.requires_grad) == (
            local.dtype, local.device, local.requires_grad,
        ), name  # fmt: skip
    for (name, mod), (_, smod) in zip(
        model.named_modules(), state.shadow.named_modules(), strict=True
    ):
        assert mod.training == smod.training, name


def test_one_attribute_and_one_accessor() -> None:
    """The model, each placeholder and each shard carry one ``_boost`` record, nothing else."""
    with fake_process_group(2):
        plain = build("tiny")
        assert parallel_state(plain) is None
        model, _ = _parallel()
        state = parallel_state(model)
        assert isinstance(state, ParallelState)
        assert state.plan is model.boost_plan and state.group.size == 2
        assert boost_compiler.parallel_state is parallel_state
        assert model.forward is state.forward and state.forward.shadow is state.shadow
        assert [k for k in vars(model) if k.startswith("_boost")] == [ATTR]
        for name, local in model.named_parameters():
            assert is_shard(local) and shadow_param(local) is None
            record = shadow_param(_shadow_params(state)[name])
            assert record is not None and record.fqn in state.params
            assert record.placement == model.boost_plan.params[record.fqn]
            assert [k for k in vars(local) if k.startswith("_boost")] == [ATTR]
        with pytest.raises(boost_compiler.errors.AlreadyParallelizedError):
            boost_compiler.parallelize(model, dist.group.WORLD, ())
        with pytest.raises(boost_compiler.errors.AlreadyParallelizedError, match="shard"):
            boost_compiler.parallelize(model.layers[0], dist.group.WORLD, ())


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.double(),
        lambda m: m.to(torch.float64),
        lambda m: m.double().float(),
    ],
    ids=["half", "bfloat16", "double", "to_float64", "double_float"],
)
def test_dtype_conversions_reach_shards_and_shadow(convert: Any) -> None:
    """Shards, placeholders and buffers convert as the single-device model's tensors do."""
    with fake_process_group(2):
        reference = build("tiny")
        model, _ = _parallel()
        convert(reference)
        convert(model)
        _agree(model)
        dtypes = {n: p.dtype for n, p in reference.named_parameters()}
        assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
        state = parallel_state(model)
        assert state is not None
        for name, buf in model.named_buffers():  # shared with the shadow, converted once
            assert dict(state.shadow.named_buffers())[name] is buf
            assert buf.dtype == dict(reference.named_buffers())[name].dtype


def test_forward_after_conversion_computes_in_the_new_dtype() -> None:
    with fake_process_group(2):
        model, ids = _parallel()
        assert model(*ids).dtype == torch.float32
        model.bfloat16()
        assert model(*ids).dtype == torch.bfloat16  # recompiled for the new placeholders
        model.float()
        assert model(*ids).dtype == torch.float32


def test_methods_of_inner_modules_reach_the_shadow() -> None:
    """``.to(dtype)``, ``eval()`` and ``requires_grad_`` on one layer change that layer only."""
    with fake_process_group(2):
        model, _ = _parallel()
        state = parallel_state(model)
        assert state is not None
        model.layers[0].double()
        model.layers[1].eval()
        model.layers[1].attn.requires_grad_(False)
        _agree(model)
        placeholders = _shadow_params(state)
        assert placeholders["layers.0.attn.q_proj.down.weight"].dtype == torch.float64
        assert placeholders["layers.1.attn.q_proj.down.weight"].dtype == torch.float32
        assert not state.shadow.layers[1].training and state.shadow.layers[0].training
        assert not placeholders["layers.1.attn.q_proj.up.weight"].requires_grad
        model.train()
        model.requires_grad_(True)
        model.float()
        _agree(model)
        assert state.shadow.layers[1].training


def test_load_state_dict_with_assign_reaches_the_shadow() -> None:
    """Assigned tensors of another dtype replace the shards: the placeholders follow."""
    with fake_process_group(2):
        model, _ = _parallel()
        local = {k: v.double() for k, v in model.layers[0].state_dict().items()}
        model.layers[0].load_state_dict(local, assign=True)
        _agree(model)
        state = parallel_state(model)
        assert state is not None
        assert _shadow_params(state)["layers.0.mlp.down_proj.down.weight"].dtype == torch.float64


@pytest.mark.parametrize(("method", "hook"), HOOK_METHODS, ids=[m for m, _ in HOOK_METHODS])
def test_hooks_on_inner_modules_after_parallelize_raise(method: str, hook: Any) -> None:
    with fake_process_group(2):
        model, _ = _parallel()
        with pytest.raises(boost_compiler.errors.HookAfterParallelizeError, match="'layers.0.mlp'"):
            getattr(model.layers[0].mlp, method)(hook)


def test_hooks_on_the_model_and_earlier_inner_hooks_run_once() -> None:
    """Hooks on the model run around the shadow once (not again inside it); inner hooks
    registered before ``parallelize`` are traced into the shadow."""
    with fake_process_group(2):
        model = build("tiny")
        ids = example_inputs(model.cfg, seq=16)
        calls: list[str] = []
        model.register_forward_hook(lambda m, i, o: calls.append("model, before"))
        model.layers[0].register_forward_hook(lambda m, i, o: calls.append("inner, before"))
        boost_compiler.parallelize(model, dist.group.WORLD, ids)
        model.register_forward_hook(lambda m, i, o: calls.append("model, after"))
        calls.clear()
        model(*ids)
        assert sorted(calls) == ["inner, before", "model, after", "model, before"]


def test_the_rule_is_in_the_public_docstring() -> None:
    doc = boost_compiler.parallelize.__doc__ or ""
    for phrase in (".half()", ".bfloat16()", ".to(dtype", "train()", "HookAfterParallelizeError"):
        assert phrase in doc, phrase


def converted_matches_single_device(*, world: int, mesh: Any) -> dict[str, Any]:
    """Parallelized in fp32, run, converted to fp64 and back: each stage vs one device.

    Per stage: the output and the gathered gradients of one forward and backward,
    against the single-device model converted the same way.
    """
    model = build("tiny", seed=3)
    (ids,) = example_inputs(model.cfg, batch=2, seq=16)
    reference = copy.deepcopy(model)
    boost_compiler.parallelize(model, mesh, (ids,))
    plan = model.boost_plan
    targets = torch.randint(
        0, model.cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(5)
    )
    errs: dict[str, dict[str, float]] = {}
    for stage, convert in (("fp32", None), ("fp64", torch.float64), ("fp32_again", torch.float32)):
        if convert is not None:
            model.to(convert)
            reference.to(convert)
        outs = []
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            out = m(ids)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1)).backward()
            outs.append(out)
        grads = {
            n: _rel(_gathered_grad(p, plan.params[n], world), q.grad)
            for (n, p), (_, q) in zip(
                model.named_parameters(), reference.named_parameters(), strict=True
            )
        }
        errs[stage] = {
            "dtype_ok": float(outs[0].dtype == outs[1].dtype == next(model.parameters()).dtype),
            "out": _rel(outs[0], outs[1]),
            "grad": max(grads.values()),
        }
    return {"errs": errs}


@pytest.fixture(scope="module")
def two() -> dict:
    return run_world(2, [("converted", "tests.test_shadow:converted_matches_single_device", ())])


def test_converted_parallel_model_matches_the_converted_single_device_model(two: dict) -> None:
    for r in ranks(result_of(two, "converted")):
        errs = r["errs"]
        print(f"rank {r['rank']}: {errs}")
        assert all(e["dtype_ok"] for e in errs.values()), errs
        for stage in ("fp32", "fp64", "fp32_again"):
            assert errs[stage]["out"] <= RTOL and errs[stage]["grad"] <= RTOL, errs


def test_fp64_parallel_model_is_fp64_accurate(two: dict) -> None:
    """Norm and loss statistics accumulate in the wider of fp32 and the input's dtype."""
    for r in ranks(result_of(two, "converted")):
        fp64 = r["errs"]["fp64"]
        assert fp64["out"] <= 1e-12 and fp64["grad"] <= 1e-12, fp64  # summation order only


def test_saving_or_copying_the_model_itself_is_refused_by_name(tmp_path: Any) -> None:
    """``torch.save(model)``/``pickle``/``deepcopy`` name the error and what to save instead."""
    import copy
    import pickle

    with fake_process_group(2):
        model, _ = _parallel()
        for attempt in (lambda: torch.save(model, tmp_path / "m.pt"),
                        lambda: pickle.dumps(model), lambda: copy.deepcopy(model)):  # fmt: skip
            with pytest.raises(
                boost_compiler.errors.ParallelModelCopyError, match="gather_state_dict"
            ):
                attempt()
        plain = build("tiny")
        torch.save(plain, tmp_path / "plain.pt")  # an unparallelized model still saves
