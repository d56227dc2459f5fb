"""Trust, compiler side (issue 25, items 1-4): no silent NaN, no late refusal, no head by name.

One 2-rank gloo world for the multi-rank checks (:mod:`tests.trust_checks`), asserted on
every rank; the refusals and the conversion report run in this process.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import boost_compiler
from boost_compiler.errors import ClosureError
from boost_compiler.tp.groups import fake_process_group
from tests.tp_harness import RTOL, ranks, result_of, run_world

ORDERS = ("fresh", "detect", "torch.compile", "second instance")


@pytest.fixture(scope="module")
def world() -> dict:
    checks = [(f"skipped/{o}", "tests.trust_checks:skipped_frame", (o,)) for o in ORDERS]
    checks += [
        ("disabled", "tests.trust_checks:disabled_submodule", ()),
        ("closure", "tests.trust_checks:closure_model", ()),
        ("meta_llama", "tests.trust_checks:meta_llama", ()),
    ]
    return run_world(2, checks)


def _exact(rank: dict) -> None:
    assert "refused" not in rank, rank["refused"]
    assert all(math.isfinite(x) for x in rank["losses"]), rank["losses"]
    assert rank["loss_err"] <= RTOL and max(rank["out_err"]) <= RTOL, rank
    assert rank["grad_err"] <= RTOL, (rank["grad_worst"], rank["grad_err"])
    assert rank["param_err"] <= RTOL, (rank["param_worst"], rank["param_err"])


@pytest.mark.parametrize("order", ORDERS)
def test_a_frame_run_as_python_raises_or_is_exact_never_nan(world: dict, order: str) -> None:
    """Item 1: whatever compiled the class before, each rank gets the error or exact numbers.

    Before the fix, every order but "fresh" trained on NaN without a word: the frame
    dynamo had given up on ran as Python on the placeholders.
    """
    for rank in ranks(result_of(world, f"skipped/{order}")):
        if "refused" in rank:
            assert rank["refused"].startswith("UncompiledFrameError"), rank["refused"]
            if order != "fresh":  # at run time: names the parameter, its module, the line
                assert "head.weight" in rank["refused"] or "'scale'" in rank["refused"]
                assert "trust_checks.py" in rank["refused"], rank["refused"]
        else:
            _exact(rank)


def test_a_disabled_submodule_raises_by_name(world: dict) -> None:
    """``torch.compiler.disable`` inside the model: the placeholder refuses to compute."""
    for rank in ranks(result_of(world, "disabled")):
        assert rank.get("refused", "").startswith("UncompiledFrameError"), rank
        assert "'1.g'" in rank["refused"] and "module '1'" in rank["refused"], rank["refused"]


def test_the_placeholder_itself_refuses_every_operation() -> None:
    """The guarantee is the placeholder's: any ATen op on it, anywhere outside dynamo."""
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(16, 4, bias=False), nn.Linear(4, 16, bias=False))
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randn(2, 16),))
        shadow = boost_compiler.parallel_state(model).shadow
        ph = shadow[0].weight
        assert isinstance(ph, nn.Parameter) and tuple(ph.shape) == (4, 16)  # global shape
        for op in (lambda t: t + 1, lambda t: t.sum(), lambda t: t.detach().clone(),
                   lambda t: torch.randn(2, 16) @ t.T, lambda t: t.double()):  # fmt: skip
            with pytest.raises(boost_compiler.errors.UncompiledFrameError, match="'0.weight'"):
                op(ph)
        with pytest.raises(boost_compiler.errors.UncompiledFrameError):
            shadow(torch.randn(2, 16))  # the shadow called directly, not through the model
        assert torch.isfinite(model(torch.randn(2, 16))).all()  # the model's own forward


def test_a_closure_over_modules_is_rebound_and_exact(world: dict) -> None:
    """Item 2: minGPT's ``self.mlpf = lambda x: m.c_proj(...)`` runs on the shadow's modules."""
    for rank in ranks(result_of(world, "closure")):
        _exact(rank)
        assert rank["fallbacks"] == [] and rank["bottlenecks"] == 2, rank


_GLOBAL_MLP = nn.Linear(8, 8)


def test_a_closure_that_cannot_be_rebound_is_refused_before_anything_changes() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    model.f = lambda x: _GLOBAL_MLP(x)  # reaches a module of the model through a global
    model.add_module("g", _GLOBAL_MLP)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with fake_process_group(2), pytest.raises(ClosureError, match="global name '_GLOBAL_MLP'"):
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randn(2, 8),))
    held = [model.g]
    model.f = lambda x: held[0](x)  # inside a list in the closure
    with fake_process_group(2), pytest.raises(ClosureError, match="inside a list"):
        boost_compiler.parallelize(model, dist.group.WORLD, (torch.randn(2, 8),))
    assert boost_compiler.parallel_state(model) is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_the_head_is_found_by_its_role_not_its_name() -> None:
    """Item 3: Meta's ``output`` head stays dense, and the report says why."""
    from tests.meta_llama import Transformer

    model = Transformer()
    report = boost_compiler.to_low_rank(model, rank=16)
    assert list(report.skipped) == ["output"], report.skipped
    assert "tok_embeddings" in report.skipped["output"]
    assert type(model.output) is nn.Linear and len(report.layers) == 2 * 7
    renamed = nn.ModuleDict({"emb": nn.Embedding(50, 16), "proj": nn.Linear(16, 50)})
    assert "proj" in boost_compiler.to_low_rank(renamed, rank=4).skipped


def test_complex_rotary_embeddings_stay_on_head_shards(world: dict) -> None:
    """Item 4: ``view_as_complex`` -> complex multiply -> ``view_as_real``, no gather of q, k."""
    for rank in ranks(result_of(world, "meta_llama")):
        _exact(rank)
        assert rank["fallbacks"] == [], rank["fallbacks"]
        gathers = [e for e in rank["wire_fwd"] if "all_gather" in e[0]]
        # the one gather is the dense head's input ([b, s, d/p]); q and k are never gathered
        assert [tuple(e[1]) for e in gathers] == [(2, 16, 32)], gathers
