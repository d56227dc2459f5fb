"""A run folder holds one run, and a run that cannot go on says so by name (issue 25, 6-11).

One process, eager, the tiny CoLA-LLaMA for a few steps: every check here is about what
the trainer does with its folder, its flags and its numbers, not about the model.
The two-process checks (a second trainer, a killed launcher) are in
``test_run_trust_procs.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from boost_compiler.errors import (
    DataError,
    DivergenceError,
    NoUsableCheckpointError,
    RunFolderError,
)
from boost_compiler.train import checkpoint as ckpt
from boost_compiler.train.config import TrainConfig, TrainConfigError, add_arguments, from_args
from boost_compiler.train.loop import read_metrics, train
from tests.extras import need
from tests.tiny_runs import QUICK, tiny_config, trained_run

_config = tiny_config


def _cli(*flags: str) -> TrainConfig:
    """The config ``boost train FLAGS`` runs (the command line's own parser)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(flags)))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


def _strict(line: str) -> Any:
    """``json.loads`` that refuses NaN / Infinity, as every non-Python JSON reader does."""

    def refuse(token: str) -> Any:
        raise ValueError(f"non-JSON token {token}")

    return json.loads(line, parse_constant=refuse)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained_run(tmp_path_factory.mktemp("run"))


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _corrupt_every_checkpoint(ckdir: Path) -> None:
    for step in ckdir.glob("step_*"):
        payload = next(step.glob("*.distcp"))
        payload.write_bytes(payload.read_bytes()[:-8])


# -- 6: --resume with every checkpoint corrupt ------------------------------------------------


def test_resume_with_every_checkpoint_corrupt_is_refused_and_changes_nothing(
    run: Path, tmp_path: Path
) -> None:
    root = _copy(run, tmp_path)
    _corrupt_every_checkpoint(root / "ckpt")
    before = _files(root)
    with pytest.raises(NoUsableCheckpointError) as err:
        train(_config(root, resume=True))
    text = str(err.value)
    assert "step_4" in text and "step_2" in text and "--resume-or-start" in text, text
    assert _files(root) == before  # neither the folders nor metrics.jsonl were touched


def test_resume_or_start_moves_the_corrupt_folders_aside_then_starts(
    run: Path, tmp_path: Path
) -> None:
    root = _copy(run, tmp_path)
    _corrupt_every_checkpoint(root / "ckpt")
    before = _files(root)
    result = train(_config(root, resume_or_start=True))
    assert result.start_step == 0 and result.final_step == 4
    aside = root / "ckpt" / "corrupt"
    for name in ("step_2", "step_4"):  # byte for byte what was there, under corrupt/
        old = {k.removeprefix(f"ckpt/{name}/"): v for k, v in before.items()
               if k.startswith(f"ckpt/{name}/")}  # fmt: skip
        assert _files(aside / name) == old
        ckpt.checked(root / "ckpt" / name)  # the new run's own checkpoint, intact
    assert (aside / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    assert sorted(read_metrics(root / "metrics.jsonl")) == [0, 1, 2, 3]


def test_resume_into_an_empty_folder_starts_but_not_over_another_runs_metrics(
    tmp_path: Path,
) -> None:
    """An empty or missing --checkpoint-dir holds nothing to lose: --resume starts there at
    step 0 (a job script that always passes --resume). Metrics of a run with no checkpoint
    are something to lose: --resume refuses, --resume-or-start sets them aside."""
    result = train(_config(tmp_path / "new", steps=1, save_every=0, resume=True))
    assert result.start_step == 0 and (tmp_path / "new" / "ckpt" / "step_1").is_dir()
    root = tmp_path / "crashed"
    root.mkdir()
    (root / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    with pytest.raises(NoUsableCheckpointError, match="holds no checkpoint.*--resume-or-start"):
        train(_config(root, steps=1, save_every=0, resume=True))
    train(_config(root, steps=1, save_every=0, resume_or_start=True))
    assert (root / "ckpt" / "corrupt" / "metrics.jsonl").read_text().startswith('{"event"')


# -- 7: a rerun without --resume into a used folder -------------------------------------------


def test_a_rerun_into_a_used_folder_is_refused_unless_overwrite(run: Path, tmp_path: Path) -> None:
    root = _copy(run, tmp_path)
    before = _files(root)
    with pytest.raises(RunFolderError, match=r"step_2, step_4.*--resume.*--overwrite"):
        train(_config(root))
    only_metrics = _config(root, checkpoint_dir=None, save_every=0)
    with pytest.raises(RunFolderError, match=r"--metrics .*metrics\.jsonl holds records"):
        train(only_metrics)
    assert _files(root) == before
    (root / "ckpt" / "step_6.tmp").mkdir()  # what a save cut short leaves
    result = train(_config(root, steps=2, overwrite=True))
    assert result.start_step == 0
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step_2"]
    starts = [r for r in map(json.loads, (root / "metrics.jsonl").read_text().splitlines())
              if r.get("event") == "start"]  # fmt: skip
    assert len(starts) == 1 and sorted(read_metrics(root / "metrics.jsonl")) == [0, 1]


# -- 10: divergence ---------------------------------------------------------------------------


def test_lr_1e6_stops_by_name_and_keeps_the_finite_checkpoint(tmp_path: Path) -> None:
    cfg = _cli("--lr", "1e6", "--keep", "1", "--save-every", "1", "--steps", "6",
               "--batch", "2", "--seq", "16", "--no-compile", "--no-progress",
               "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--metrics", str(tmp_path / "metrics.jsonl"))  # fmt: skip
    with pytest.raises(DivergenceError, match=r"step \d+: non-finite (loss|gradient norm)") as e:
        train(cfg)
    step = int(str(e.value).split()[1].rstrip(":"))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [_strict(line) for line in lines]  # every line is strict JSON
    assert records[-1]["event"] == "nonfinite" and records[-1]["step"] == step
    assert records[-1]["loss"] is None or math.isfinite(records[-1]["loss"])
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == [f"step_{step}"] if step > 0 else kept == []
    if step > 0:  # the checkpoint --keep 1 left is the last finite model
        sd, _ = ckpt.single_device_state_dict(tmp_path / "ckpt" / f"step_{step}")
        assert all(bool(t.isfinite().all()) for t in sd.values() if t.is_floating_point())


def test_on_nonfinite_skip_skips_the_step_and_continues(tmp_path: Path) -> None:
    result = train(_config(tmp_path, lr=1e6, steps=4, save_every=0, on_nonfinite="skip"))
    assert result.final_step == 4
    records = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("event") == "nonfinite"]
    assert skipped and all(r["action"] == "skip" for r in skipped)
    sd, _ = ckpt.single_device_state_dict(tmp_path / "ckpt" / "step_4")
    assert all(bool(t.isfinite().all()) for t in sd.values() if t.is_floating_point())


@pytest.mark.parametrize("value", ["nan", "inf", "-1e-3"])
def test_a_non_finite_or_negative_lr_is_refused_up_front(value: str, tmp_path: Path) -> None:
    cfg = _cli(f"--lr={value}", "--checkpoint-dir", str(tmp_path / "ckpt"))
    with pytest.raises(TrainConfigError, match="--lr must be"):
        train(cfg)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was made


# -- 11: named errors where raw ones were ----------------------------------------------------


def test_a_garbage_parquet_file_is_a_data_error_naming_it(tmp_path: Path) -> None:
    need("datasets")
    bad = tmp_path / "corpus.parquet"
    bad.write_bytes(b"this is not a parquet file\n" * 4)
    with pytest.raises(DataError, match=r"corpus\.parquet: not a readable parquet file"):
        train(TrainConfig(steps=1, data=[str(bad)], **QUICK))


def test_a_malformed_jsonl_line_is_named_by_its_line_number(tmp_path: Path) -> None:
    need("datasets")
    path = tmp_path / "corpus.jsonl"
    good = [json.dumps({"text": f"document {i} " * 8}) for i in range(19)]
    path.write_text("\n".join([*good, '{"text": "cut off', good[0]]) + "\n")
    with pytest.raises(DataError, match=r"corpus\.jsonl: line 20 is not a JSON object"):
        train(TrainConfig(steps=1, data=[str(path)], **QUICK))


def test_a_checkpoint_dir_under_a_file_fails_before_the_first_step(tmp_path: Path) -> None:
    (tmp_path / "somefile").write_text("a file")
    cfg = _cli("--checkpoint-dir", str(tmp_path / "somefile" / "ckpt"), "--steps", "3",
               "--no-compile", "--no-progress", "--metrics", str(tmp_path / "m.jsonl"))  # fmt: skip
    with pytest.raises(RunFolderError, match=r"--checkpoint-dir .*somefile is a file"):
        train(cfg)
    assert not (tmp_path / "m.jsonl").exists() or not read_metrics(tmp_path / "m.jsonl")


def test_metrics_naming_a_folder_is_refused_at_start(tmp_path: Path) -> None:
    cfg = _cli("--metrics", str(tmp_path), "--steps", "1", "--no-compile", "--no-progress")
    with pytest.raises(RunFolderError, match=r"--metrics .* is a folder.*metrics\.jsonl"):
        train(cfg)


def test_tp_2_without_a_launcher_names_torchrun() -> None:
    with pytest.raises(TrainConfigError) as err:
        train(_cli("--tp", "2", "--no-compile", "--no-progress"))
    text = str(err.value)
    assert "world size 1" in text and "torchrun --standalone --nproc-per-node 2" in text, text
    assert "dp (0)" not in text


@pytest.mark.parametrize("model_type", ["bert", "mamba"])
def test_an_unsupported_hf_model_type_is_refused_with_the_list(
    model_type: str, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    cfg = _cli("--hf-config", str(tmp_path), "--no-compile", "--no-progress", "--steps", "1")
    with pytest.raises(TrainConfigError, match=rf"model_type '{model_type}' is not.*llama, qwen2"):
        train(cfg)


def test_parameters_overflowed_by_a_finite_step_are_never_saved(tmp_path: Path) -> None:
    """A finite gradient, but weight decay x lr overflows every weight to inf in one step:
    the loss only shows it a step later, the save at the end of this one must not."""
    cfg = _config(tmp_path, lr=1e6, weight_decay=1e35, steps=1, save_every=0)
    with pytest.raises(DivergenceError, match=r"step 1: the parameters hold NaN/inf.*not saved"):
        train(cfg)
    assert not list((tmp_path / "ckpt").glob("step_*"))


def test_a_wrapped_collective_failure_waits_for_the_dying_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.distributed.pipelining re-raises a stage's gloo error as a new RuntimeError; a
    SIGKILLed peer's sockets close a moment before /proc shows it exited. Both once made a
    rank of test_killed_rank_is_named_and_resume_continues die with the raw error."""
    from boost_compiler.train import comm

    inner = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    outer = RuntimeError("Failed to run stage backward")
    outer.__cause__ = inner
    assert comm._is_comm_error(outer) and not comm._is_comm_error(RuntimeError("shape mismatch"))
    peer = comm.Peer(2, "host", 1234)
    answers = iter([[], [], [(peer, "exited (killed or crashed)")]])

    class Slow:
        def lost(self) -> list:
            return next(answers)

    assert comm._lost_after(Slow(), 5.0) == [(peer, "exited (killed or crashed)")]
