"""The plan as a file (issue 27, item 4): saved, loaded, forced, refused by name.

Structure only here (the fake process group, eager lowering): the JSON round trip,
``boost explain``'s ``plan.json`` forced by ``parallelize(..., plan=)`` giving the same
placements and the same collectives read off the rewritten graphs, and every way a plan
can fail to fit, refused before anything is modified. The numbers of forced and edited
plans on two real ranks are in ``tests/test_plan_forced.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import boost_compiler
from boost_compiler.errors import PlanFileError, PlanMismatchError
from boost_compiler.explain import explain
from boost_compiler.models.cola_llama import build, example_inputs
from boost_compiler.parallel.shadow import parallel_state
from boost_compiler.tp.groups import fake_process_group
from boost_compiler.tp.placement import Placement, S
from boost_compiler.tp.plan import TPPlan


def _collectives(plan: TPPlan) -> list[tuple]:
    return [(c.kind, tuple(map(str, c.global_shape)), c.forward, c.backward)
            for c in plan.collectives]  # fmt: skip


def _parallelized(plan: TPPlan | str | Path | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build("tiny")
    boost_compiler.parallelize(model, dist.group.WORLD, example_inputs(model.cfg), plan=plan)
    return model


@pytest.mark.parametrize("text", ["R", "P", "S(0)", "S(1)", "S(1, blocks=[64, 32, 32])"])
def test_a_placement_reads_back_from_its_text(text: str) -> None:
    assert str(Placement.parse(text)) == text


@pytest.mark.parametrize("text", ["S", "S(-1)", "Shard(0)", "S(1, blocks=[a])", ""])
def test_a_malformed_placement_is_named(text: str) -> None:
    with pytest.raises(PlanFileError, match="is not a placement"):
        Placement.parse(text, "'w'")


def test_explain_saves_the_plan_that_parallelize_forces(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("tiny")
    report = explain(model, example_inputs(model.cfg), tp=2, out_dir=tmp_path)
    saved = tmp_path / "plan.json"
    assert report.files["plan.json"] == saved
    data = json.loads(saved.read_text())
    assert data["format"] == "boost-plan" and data["p"] == 2 and data["model"] == "ColaLlama"
    again = json.loads(json.dumps(TPPlan.from_json(data).to_json("ColaLlama")))
    assert again == data  # the whole plan survives the round trip
    with fake_process_group(2):
        decided = _parallelized().boost_plan
        forced = _parallelized(saved).boost_plan
    assert any(pl.is_shard for pl in decided.params.values())
    assert forced.params == decided.params == TPPlan.load(saved).params
    assert _collectives(forced) == _collectives(decided) == _collectives(report.plan)
    assert forced.forced_from == str(saved) and decided.forced_from is None
    assert forced.fallbacks == decided.fallbacks == []


def _saved(tmp_path: Path) -> Path:
    with fake_process_group(2):
        return _parallelized().boost_plan.save(tmp_path / "plan.json")


def _edit(path: Path, fn) -> Path:  # noqa: ANN001 (a lambda on the JSON)
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))
    return path


_DOWN = "layers.0.attn.q_proj.down.weight"  # [16, 64]: r x d


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(p=4), "the plan is for tp=4, the mesh has 2 ranks"),
        (lambda d: d["params"].pop(_DOWN), f"'{_DOWN}': in the model, not in the plan"),
        (lambda d: d["params"].update(extra={"placement": "R", "shape": [2]}),
         "'extra': in the plan, not in the model"),
        (lambda d: d["params"][_DOWN].update(shape=[8, 64]), "the plan's shape \\[8, 64\\]"),
        (lambda d: d["params"][_DOWN].update(placement="P"), "cannot be partial"),
        (lambda d: d["params"][_DOWN].update(placement="S(2)"), "names dim 2 of a 2-d"),
        (lambda d: d["params"][_DOWN].update(placement="S(1, blocks=[61, 3])"),
         "splits size 61 over p=2"),
        (lambda d: d["params"][_DOWN].update(placement="S(1, blocks=[32, 30])"), "blocks sum"),
        (lambda d: d["params"]["layers.0.attn_norm.weight"].update(placement="S(0, blocks=[32, 32])"),
         "in blocks that no fused up factor reads"),
        ("not a plan", "takes a TPPlan or the path"),
    ],
)  # fmt: skip
def test_a_plan_that_does_not_fit_is_refused_by_name_and_nothing_changes(
    tmp_path: Path,
    edit,
    match: str,  # noqa: ANN001
) -> None:
    path = _edit(_saved(tmp_path), edit) if callable(edit) else {"p": 2}
    with fake_process_group(2):
        torch.manual_seed(0)
        model = build("tiny")
        before = {n: (prm, prm.detach().clone()) for n, prm in model.named_parameters()}
        with pytest.raises((PlanMismatchError, PlanFileError), match=match):
            boost_compiler.parallelize(model, dist.group.WORLD, example_inputs(model.cfg),
                                       plan=path)  # fmt: skip
    assert parallel_state(model) is None and not hasattr(model, "boost_plan")
    for name, prm in model.named_parameters():
        assert prm is before[name][0] and torch.equal(prm, before[name][1]), name


@pytest.mark.parametrize(
    "content, match",
    [("{", "cannot read a plan"), ('{"format": "x"}', "not a boost plan"),
     ('{"format": "boost-plan", "version": 99}', "version 99"),
     ('{"format": "boost-plan", "version": 1, "p": 2}', "malformed plan")],
)  # fmt: skip
def test_a_file_that_is_not_a_plan_is_named(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanFileError, match=match):
        TPPlan.load(path)


def test_an_edited_placement_that_fits_is_what_runs(tmp_path: Path) -> None:
    """A down factor forced whole: the plan holds it replicated, and the graph reads it so."""
    path = _edit(_saved(tmp_path), lambda d: d["params"][_DOWN].update(placement="R"))
    with fake_process_group(2):
        decided = _parallelized().boost_plan
        forced = _parallelized(path)
        plan = forced.boost_plan
    assert decided.params[_DOWN] == S(1) and plan.params[_DOWN] == Placement("R")
    shard = dict(forced.named_parameters())[_DOWN]
    assert tuple(shard.shape) == (16, 64)  # held whole on each rank
    assert plan.rank_memory().params > decided.rank_memory().params
    assert {k: v for k, v in plan.params.items() if k != _DOWN} == {
        k: v for k, v in decided.params.items() if k != _DOWN}  # fmt: skip


def test_the_plan_calls_only_the_head_a_vocabulary_head() -> None:
    """A dense MLP split on its outputs before the loss is recorded as what it is."""
    with fake_process_group(2):
        torch.manual_seed(0)
        cola = build("tiny", vocab_size=512)
        ids = example_inputs(cola.cfg)
        boost_compiler.parallelize(cola, dist.group.WORLD, ids, {"labels": ids[0]})
        # (the planner's weighed choices are decisions too: every one says so)
        heads = [d for d in cola.boost_plan.decisions if "weighed against" not in d]
        assert heads == [
            "lm_head.weight: vocabulary-parallel head, its logits reach a cross-entropy"
        ]
        model = build("tiny", vocab_size=512)
        for layer in model.layers:  # dense SwiGLU, low-rank attention
            for name in ("gate_proj", "up_proj", "down_proj"):
                old = getattr(layer.mlp, name)
                dense = torch.nn.Linear(old.down.in_features, old.up.out_features, bias=False)
                setattr(layer.mlp, name, dense)
        ids = example_inputs(model.cfg)
        boost_compiler.parallelize(model, dist.group.WORLD, ids, {"labels": ids[0]})
        decisions = model.boost_plan.decisions
    assert decisions and not any("mlp" in d and "vocabulary" in d for d in decisions), decisions
    assert any("mlp.gate_proj" in d and "column-parallel" in d for d in decisions), decisions
