"""What a checkpoint folder may make boost do: resolve exact DCP classes only, load only the
files its manifest checks, and name every damaged file or field instead of a raw error.

One process, eager: a 4-step run of the tiny CoLA-LLaMA saving every 2 steps gives two
real DCP checkpoints; each test tampers with a copy of the newer one (step_4) and checks
that the error names it and that ``latest_valid`` (what ``--resume`` uses) falls back to
step_2.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import pickle
import shlex
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from boost_compiler.cli import main
from boost_compiler.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from boost_compiler.train import checkpoint as ckpt
from boost_compiler.train import integrity
from boost_compiler.train.config import TrainConfig
from boost_compiler.train.loop import train
from tests.tiny_runs import tiny_config, trained_run

DCP_METADATA = "torch.distributed.checkpoint.metadata"


def _config(root: Path, **kw: Any) -> TrainConfig:
    return tiny_config(root, **{"plot": None, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained_run(tmp_path_factory.mktemp("run"), plot=None)


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run, and its step_4 folder."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "ckpt" / "step_4"


def _falls_back(root: Path, *why: str) -> list[str]:
    found, skipped = ckpt.latest_valid(root / "ckpt")
    assert found == root / "ckpt" / "step_2"
    assert len(skipped) == 1 and "step_4" in skipped[0], skipped
    for text in why:
        assert text in skipped[0], skipped
    return skipped


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _global(module: str, name: str, *call: str) -> bytes:
    """Protocol-4 pickle bytes, written by hand: ``STACK_GLOBAL(module, name)``, called with
    the string arguments ``call`` when there are any (``MARK ... TUPLE REDUCE``)."""
    out = b"\x80\x04" + _str(module) + _str(name) + b"\x93"
    if call:
        out += b"(" + b"".join(_str(a) for a in call) + b"tR"
    return out + b"."


def _unpickle(data: bytes) -> Any:
    return integrity._MetadataUnpickler(io.BytesIO(data), Path("x/.metadata")).load()


# -- 5: a dotted name through an allowed module ----------------------------------------------


def test_a_dotted_global_through_an_allowed_module_runs_nothing(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, step = _copy(run, tmp_path)
    marker = tmp_path / "pwned"
    # metadata imports os: protocol 4 resolves "os.system" attribute by attribute from it
    payload = _global(DCP_METADATA, "os.system", f"touch {shlex.quote(str(marker))}")
    (step / ".metadata").write_bytes(payload)
    integrity.write_manifest(step)  # the attacker rewrites the manifest too
    with pytest.raises(
        UnsafeCheckpointError, match=rf"step_4/\.metadata.*{DCP_METADATA}\.os\.system"
    ):
        integrity.read_metadata(step)
    with pytest.raises(UnsafeCheckpointError, match="os.system"):
        ckpt.export(step, tmp_path / "out.safetensors")
    assert main(["export", "--checkpoint", str(step), "--out", str(tmp_path / "o.pt")]) == 2
    assert "os.system" in capsys.readouterr().err
    assert not marker.exists()
    # --resume passes over it to step_2 and trains on from there
    _falls_back(root, "os.system")
    assert train(_config(root, resume=True)).start_step == 2
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()
    # the payload is live: pickle's own loader runs it
    pickle.loads(payload)
    assert marker.exists()


def _candidates() -> set[tuple[str, str]]:
    """Every attribute of every allowlisted module, and every dotted ``a.b`` below those."""
    out: set[tuple[str, str]] = set()
    for module in sorted({m for m, _ in integrity.ALLOWED}):
        mod = importlib.import_module(module)
        for a in dir(mod):
            out.add((module, a))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    inner = dir(getattr(mod, a))
                except Exception:  # noqa: BLE001 - a lazy attribute may fail: still tried above
                    continue
            out.update((module, f"{a}.{b}") for b in inner)
    return out


def test_only_the_exact_allowlisted_globals_resolve() -> None:
    candidates = _candidates() | {("builtins", "eval"), ("os", "system"), ("torch", "load"),
                                  ("posix", "system"), ("collections", "OrderedDict")}  # fmt: skip
    assert len(candidates) > 10_000  # torch alone has thousands: the sweep is real
    accepted = set()
    for module, name in candidates:
        try:
            obj = _unpickle(_global(module, name))
        except UnsafeCheckpointError:
            continue
        assert obj is getattr(importlib.import_module(module), name)
        accepted.add((module, name))
    assert accepted == integrity.ALLOWED
    assert not any("." in name for _, name in integrity.ALLOWED)
    # the old-protocol GLOBAL opcode reaches the same check
    with pytest.raises(UnsafeCheckpointError):
        _unpickle(f"c{DCP_METADATA}\nos.system\n.".encode())


def test_the_allowlist_reads_a_real_save(run: Path) -> None:
    """Every pair is one a boost save's metadata needs, or a dtype a tensor may have."""
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO((run / "ckpt" / "step_4" / ".metadata").read_bytes())).load()
    assert seen <= integrity.ALLOWED
    extra = {n for m, n in integrity.ALLOWED - seen}
    import torch

    assert all(isinstance(getattr(torch, n), torch.dtype) for n in extra), extra


def test_a_storage_path_out_of_the_folder_is_refused(run: Path, tmp_path: Path) -> None:
    """Bytes outside the step folder are not covered by its manifest: never read."""
    root, step = _copy(run, tmp_path)
    meta = integrity.read_metadata(step)
    for info in meta.storage_data.values():
        info.relative_path = "../step_2/" + info.relative_path
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    integrity.write_manifest(step)
    with pytest.raises(UnsafeCheckpointError, match=r"'\.\./step_2/__0_0\.distcp'"):
        ckpt.checked(step)
    _falls_back(root, "../step_2")


# -- 5: the manifest lists every file -----------------------------------------------------


def _drop(name: str) -> Any:
    def edit(manifest: dict[str, Any], step: Path) -> Any:
        del manifest["files"][name]
        return manifest

    return edit


def _entry(field: str) -> Any:
    def edit(manifest: dict[str, Any], step: Path) -> Any:
        del manifest["files"][".metadata"][field]
        return manifest

    return edit


def _add_file(manifest: dict[str, Any], step: Path) -> Any:
    (step / "extra.distcp").write_bytes(b"not in the manifest")
    return manifest


MANIFESTS = {
    "a list": (lambda m, s: [], "'files' is a non-empty object"),
    "files a list": (lambda m, s: {"files": [1]}, "'files' is a non-empty object"),
    "no files": (lambda m, s: {"files": {}}, "'files' is a non-empty object"),
    "not an object": (lambda m, s: "x", "'files' is a non-empty object"),
    "entry not an object": (lambda m, s: {"files": {".metadata": 1}}, "files['.metadata']"),
    "no bytes": (_entry("bytes"), "files['.metadata'] must"),
    "no sha256": (_entry("sha256"), "files['.metadata'] must"),
    "bytes a string": (lambda m, s: {**m, "files": {**m["files"], "train_state.json": {
        **m["files"]["train_state.json"], "bytes": "10"}}}, "files['train_state.json']"),
    "payload unlisted": (_drop("__0_0.distcp"), "holds ['__0_0.distcp'], which manifest.json"),
    ".metadata unlisted": (_drop(".metadata"), "does not list .metadata"),
    "a file added": (_add_file, "holds ['extra.distcp'], which manifest.json"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_malformed_or_partial_manifest_is_named(run: Path, tmp_path: Path, case: str) -> None:
    root, step = _copy(run, tmp_path)
    edit, why = MANIFESTS[case]
    manifest = step / integrity.MANIFEST
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()), step)))
    with pytest.raises(CheckpointCorruptError, match="step_4") as info:
        integrity.verify(step)
    assert why in str(info.value)
    _falls_back(root, why)


# -- 11 (i): a deleted file of a finished save is said, an unfinished save is not --------------


@pytest.mark.parametrize("name", [".metadata", "manifest.json", "train_state.json"])
def test_a_deleted_file_is_reported_not_ignored(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    root, step = _copy(run, tmp_path)
    (step / name).unlink()
    unfinished = root / "ckpt" / "step_6.tmp"
    shutil.copytree(root / "ckpt" / "step_2", unfinished)
    (unfinished / integrity.MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="boost_compiler"):
        _falls_back(root, f"incomplete: missing {name}")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"step_4: incomplete: missing {name}" in warned[0]
    assert "step_6" not in " ".join(warned)
    with pytest.raises(CheckpointCorruptError, match=f"step_4: not a finished.*{name}"):
        ckpt.resolve(step)


# -- 11 (ii): train_state.json is checked field by field -----------------------------------


def _without(key: str) -> Any:
    return lambda s: {k: v for k, v in s.items() if k != key}


STATES = {
    "step a string": (lambda s: {**s, "step": "abc"}, "'step' must be an integer"),
    "step huge": (lambda s: {**s, "step": 1e30}, "'step' must be an integer"),
    "step huge int": (lambda s: {**s, "step": 10**13}, "'step' must be an integer"),
    "step negative": (lambda s: {**s, "step": -3}, "'step' must be an integer"),
    "step a bool": (lambda s: {**s, "step": True}, "'step' must be an integer"),
    "step not the folder's": (lambda s: {**s, "step": 3}, "'step' must be 4"),
    "no step": (_without("step"), "'step' must be an integer in [0, 1000000000000]; got nothing"),
    "keys a number": (lambda s: {**s, "keys": 5}, "'keys' must be a non-empty list"),
    "no keys": (_without("keys"), "'keys' must be"),
    "aliases to nothing": (lambda s: {**s, "aliases": {"a": "nope"}}, "'aliases' must"),
    "data a string": (lambda s: {**s, "data": "x"}, "'data' must be an object"),
    "config a list": (lambda s: {**s, "config": []}, "'config' must be an object"),
    "not an object": (lambda s: [s], "must be a JSON object"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STATES))
def test_a_malformed_train_state_is_named(run: Path, tmp_path: Path, case: str) -> None:
    root, step = _copy(run, tmp_path)
    edit, why = STATES[case]
    file = step / ckpt.STATE_FILE
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))
    integrity.write_manifest(step)  # the file is what was saved: only its fields are wrong
    with pytest.raises(CheckpointCorruptError, match=r"step_4/train_state\.json") as info:
        ckpt.checked(step)
    assert why in str(info.value)
    with pytest.raises(CheckpointCorruptError, match="train_state.json"):
        ckpt.export(step, tmp_path / "out.safetensors")
    _falls_back(root, why)


def test_resume_passes_over_a_malformed_train_state(run: Path, tmp_path: Path) -> None:
    root, step = _copy(run, tmp_path)
    file = step / ckpt.STATE_FILE
    file.write_text(json.dumps({**json.loads(file.read_text()), "data": "x"}))
    integrity.write_manifest(step)
    assert train(_config(root, resume=True)).start_step == 2


# -- 11 (iii): another rank or width is named before DCP sees it -------------------------------


def test_resume_at_another_rank_names_key_shapes_and_flag(run: Path, tmp_path: Path) -> None:
    root, _ = _copy(run, tmp_path)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'model\.[\w.]+' is \(\d+, \d+\) in the checkpoint but \(\d+, \d+\) in this run's "
        r"model: the low-rank rank \(--rank / --rank-ratio.*\[model\] rank\).*saved run's "
        r"\(--model tiny, --rank-ratio 0\.25, --rank-multiple 8\)",
    ):
        train(_config(root, resume=True, model_overrides={"rank": 8}))
    with pytest.raises(CheckpointMismatchError, match=r"in the checkpoint but .*model size"):
        train(_config(root, resume=True, model_overrides={"d_model": 128}))
