"""Checkpoint folders are data, never code; changed bytes are found; --resume falls back.

One process, eager: a 4-step run of the tiny CoLA-LLaMA saving every 2 steps gives
two real DCP checkpoints to tamper with.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from boost_compiler.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from boost_compiler.train import checkpoint as ckpt
from boost_compiler.train import integrity
from boost_compiler.train.config import TrainConfigError
from boost_compiler.train.loop import read_metrics, train
from tests.tiny_runs import tiny_config, trained_run

_config = tiny_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained_run(tmp_path_factory.mktemp("run"))


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


class _Touch:
    """A pickle payload that creates a file when unpickled (what an attacker would ship)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_crafted_metadata_raises_and_runs_nothing(run: Path, tmp_path: Path) -> None:
    root = _copy(run, tmp_path)
    step = root / "ckpt" / "step_4"
    witness = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_Touch(witness)))
    integrity.write_manifest(step)  # the attacker rewrites the manifest too
    with pytest.raises(UnsafeCheckpointError, match=r"step_4/\.metadata.*io\.open"):
        ckpt.export(step, tmp_path / "out.safetensors")
    assert not witness.exists()
    with pytest.raises(UnsafeCheckpointError):
        ckpt.checked(step)
    assert not witness.exists()
    # the same file through torch's own reader would have run it: the test's payload is live
    pickle.loads((step / ".metadata").read_bytes()).close()
    assert witness.exists()


def test_a_flipped_payload_byte_is_found_and_named(run: Path, tmp_path: Path) -> None:
    root = _copy(run, tmp_path)
    step = root / "ckpt" / "step_4"
    payload = next(step.glob("*.distcp"))
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=f"step_4/{payload.name}.*checksum"):
        ckpt.export(step, tmp_path / "out.safetensors")
    (step / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointCorruptError, match=r"step_4/\.metadata"):
        ckpt.checked(step)


def test_truncated_and_unfinished_checkpoints_are_named(run: Path, tmp_path: Path) -> None:
    root = _copy(run, tmp_path)
    step = root / "ckpt" / "step_4"
    payload = next(step.glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match="100 bytes.*truncated"):
        ckpt.checked(step)
    (step / integrity.MANIFEST).unlink()
    with pytest.raises(CheckpointCorruptError, match="manifest.json missing"):
        ckpt.resolve(step)


def test_resume_falls_back_to_the_previous_intact_checkpoint(run: Path, tmp_path: Path) -> None:
    root = _copy(run, tmp_path)
    newest = root / "ckpt" / "step_4"
    payload = next(newest.glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:-8])
    found, skipped = ckpt.latest_valid(root / "ckpt")
    assert found == root / "ckpt" / "step_2" and len(skipped) == 1 and "step_4" in skipped[0]
    assert ckpt.resolve(root / "ckpt") == root / "ckpt" / "step_2"
    result = train(_config(root, resume=True))
    assert result.start_step == 2
    start = [json.loads(line) for line in Path(root / "metrics.jsonl").read_text().splitlines()
             if '"start"' in line][-1]  # fmt: skip
    assert start["step"] == 2 and "step_4" in start["skipped_checkpoints"][0]
    # the resumed steps (2 and 3, counted from 0) reproduce the uninterrupted run's losses
    want, got = read_metrics(run / "metrics.jsonl"), read_metrics(root / "metrics.jsonl")
    for s in (2, 3):
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5)


def test_no_intact_checkpoint_says_why(run: Path, tmp_path: Path) -> None:
    root = _copy(run, tmp_path)
    for step in (root / "ckpt").iterdir():
        (step / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no complete, intact checkpoint.*skipped"):
        ckpt.resolve(root / "ckpt")


def test_a_run_without_output_folders_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.png").write_bytes(b"the user's own file")
    result = train(_config(tmp_path, steps=2, save_every=0, checkpoint_dir=None, metrics=None,
                           plot=None))  # fmt: skip
    assert result.plot is None and len(result.losses) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
    assert (tmp_path / "loss.png").read_bytes() == b"the user's own file"


def test_keep_and_a_changed_schedule(run: Path, tmp_path: Path) -> None:
    """--keep 1 leaves the newest checkpoint only; --resume with another --steps, --lr,
    --warmup or --min-lr-ratio (each a part of the schedule the README names) raises by
    name unless --allow-schedule-change."""
    root = tmp_path / "keep"
    train(_config(root, keep=1))
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step_4"]
    moved = _copy(run, tmp_path)
    with pytest.raises(TrainConfigError, match=r"--steps 6 \(saved: 4\).*--allow-schedule-change"):
        train(_config(moved, resume=True, steps=6))
    with pytest.raises(TrainConfigError, match=r"--lr 0.01 \(saved: 0.003\)"):
        train(_config(moved, resume=True, lr=0.01))
    with pytest.raises(TrainConfigError, match=r"--warmup 2 \(saved: 1\)"):
        train(_config(moved, resume=True, warmup=2))
    with pytest.raises(TrainConfigError, match=r"--min-lr-ratio 0.5 \(saved: 0.1\)"):
        train(_config(moved, resume=True, min_lr_ratio=0.5))
    result = train(_config(moved, resume=True, steps=6, allow_schedule_change=True))
    assert result.start_step == 4 and result.final_step == 6
