"""The trainer asks one model spec per family (train/model_spec.py, issue 43 item 3): a
user's ``--model module:function`` (tests/user_model.py) trains under ``boost train``
across ranks to the losses of its one-process run, and no trainer module branches on
the family outside that family's spec.

Both in CI, eager, the tiny model (about 10 s each on 2 cores): tp=2 on 2 ranks and
tp=2 x pp=2 on 4 ranks.
Ranks are forks of examples/train.py as in tests/test_train.py (its ``Launch``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from boost_compiler.errors import PipelineError
from boost_compiler.train import TrainConfig, read_metrics
from boost_compiler.train.families import spec_for
from boost_compiler.train.spec_module import LayeredLM

from .test_train import ROOT, Launch, _in_process, _losses, _max_rel

USER = "tests.user_model:build"
RUN = {"steps": 3, "save_every": 100, "model": USER}
RTOL = 1e-5


def _launch(tmp: Path, name: str, world: int, **kw: Any) -> dict[int, float]:
    """The run's losses, after checking it ran in the layout asked, with BTP collectives."""
    metrics = tmp / name / "metrics.jsonl"
    run = Launch.start(world, tmp / name, checkpoint_dir=tmp / name / "ckpt", metrics=metrics,
                       **RUN, **kw)  # fmt: skip
    run.wait()
    state = json.loads((tmp / name / "ckpt" / "step_3" / "train_state.json").read_text())
    assert state["layout"]["pp"] == kw.get("pp", 1) and state["layout"]["tp"] == kw["tp"]
    assert all(r["tp_collective_bytes"] > 0 for r in read_metrics(metrics).values())
    return _losses(metrics)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("spec_single")
    result = _in_process(checkpoint_dir=str(tmp / "ckpt"), metrics=str(tmp / "m.jsonl"), **RUN)
    return dict(result.losses)


def test_user_model_tp2_matches_one_process(single: dict[int, float], tmp_path: Path) -> None:
    """``--model module:function`` at tp=2 (BTP over the user's low-rank layers)."""
    got = _launch(tmp_path, "tp2", 2, tp=2)
    assert len(got) == RUN["steps"]
    assert _max_rel(got, single) < RTOL, (got, single)


def test_user_model_tp2_pp2_matches_one_process(single: dict[int, float], tmp_path: Path) -> None:
    """The user's ``LayeredLM`` cut into 2 stages, each parallelized over tp=2."""
    got = _launch(tmp_path, "tp2pp2", 4, tp=2, pp=2)
    assert len(got) == RUN["steps"]
    assert _max_rel(got, single) < RTOL, (got, single)


def test_spec_picked_by_flags_and_pp_needs_layers(tmp_path: Path) -> None:
    """Each kind claims its flags; --pp refuses a user's model it cannot cut, by name."""
    names = {m: spec_for(TrainConfig(model=m)).name for m in ("tiny", USER)}
    assert names == {"tiny": "cola-llama", USER: "module:function"}
    assert spec_for(TrainConfig(hf_config=str(tmp_path))).name == "transformers"
    spec = spec_for(TrainConfig(model=USER))
    model = spec.build(TrainConfig(model=USER))
    assert isinstance(model, LayeredLM)
    assert spec.pipeline_dims(model) == (4, 32, False)
    with pytest.raises(PipelineError, match="LayeredLM"):
        spec.pipeline_dims(torch.nn.Linear(2, 2))
    head = torch.nn.Linear(32, 256, bias=False)
    head.weight = model.embed.weight  # tied: the first and last stage would share it
    tied = LayeredLM(model.embed, list(model.layers), head, d_model=32)
    assert spec.pipeline_dims(tied) == (4, 32, True)


def test_no_family_branch_outside_its_spec() -> None:
    """``is_hf`` / the CoLA stage / HF probes appear only in their family's modules."""
    own = {
        "hf_model.py",
        "pipeline_hf.py",
        "spec_cola.py",
        "spec_module.py",
        "model_spec.py",
        "families.py",
    }
    pattern = re.compile(r"\bis_hf\b|is_hf_causal_lm|CoLAStage|ColaLlama|\.config\.model_type")
    bad = [
        f"{path.name}:{n}"
        for path in sorted((ROOT / "boost_compiler" / "train").glob("*.py"))
        if path.name not in own
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not bad, bad
