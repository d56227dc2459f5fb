"""A model folder never makes boost run its Python files: ``boost explain`` (and
``from_pretrained``) refuse a ``config.json`` that asks for them, before transformers reads
it, even when the user would answer "y" to transformers' prompt."""

from __future__ import annotations

import argparse
import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extras import need

need("transformers")

import boost_compiler  # noqa: E402
from boost_compiler.cli import explain as explain_cli  # noqa: E402
from boost_compiler.cli import main  # noqa: E402
from boost_compiler.errors import HFFolderError, RemoteCodeError  # noqa: E402
from boost_compiler.hf_io import refuse_remote_code  # noqa: E402

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 256}  # fmt: skip


def _remote_folder(tmp_path: Path, model_type: str = "evilmodel") -> tuple[Path, Path]:
    """A folder whose config.json maps the Auto classes to its own files, which create
    ``marker`` when imported; the folder and the marker's path."""
    folder, marker = tmp_path / "remote", tmp_path / "ran-the-folder's-code"
    folder.mkdir()
    code = (f"open({str(marker)!r}, 'w').close()\n"
            "from transformers import PretrainedConfig\n"
            f"class EvilConfig(PretrainedConfig):\n    model_type = {model_type!r}\n")  # fmt: skip
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code)
    config = {**TINY_LLAMA, "model_type": model_type,
              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                           "AutoModelForCausalLM": "modeling_evil.EvilModel"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def _args(folder: Path, out: Path) -> argparse.Namespace:
    return argparse.Namespace(factory=str(folder), tp=2, out=str(out), layer=None, off=[],
                              rank_ratio=None)  # fmt: skip


@pytest.mark.parametrize("model_type", ["evilmodel", "llama"])
def test_explain_refuses_auto_map_even_on_yes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    model_type: str,
) -> None:  # fmt: skip
    folder, marker = _remote_folder(tmp_path, model_type)
    # the user at the terminal answers transformers' "run the custom code? [y/N]" with y
    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")
    with pytest.raises(RemoteCodeError, match=r"remote/config\.json: 'auto_map'"):
        explain_cli._run(_args(folder, tmp_path / "report"))
    assert main(["explain", str(folder), "--out", str(tmp_path / "report")]) == 2
    assert "'auto_map'" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "report").exists()


def test_explain_cli_with_stdin_closed_refuses_and_runs_nothing(tmp_path: Path) -> None:
    folder, marker = _remote_folder(tmp_path)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "boost_compiler.cli", "explain", str(folder),
                           "--out", str(tmp_path / "report")], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "'auto_map'" in done.stderr and "never does" in done.stderr
    assert not marker.exists()


def test_an_unknown_model_type_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "not_a_model"}))
    with pytest.raises(RemoteCodeError, match=r"odd/config\.json: 'model_type' 'not_a_model'"):
        explain_cli._run(_args(folder, tmp_path / "report"))
    (folder / "config.json").write_text("[1]")
    with pytest.raises(HFFolderError, match=r"odd/config\.json: must be a JSON object"):
        refuse_remote_code(folder)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert refuse_remote_code(folder)["model_type"] == "llama"  # a built-in one passes


def test_from_pretrained_refuses_auto_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, marker = _remote_folder(tmp_path, "llama")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")
    with pytest.raises(RemoteCodeError, match="'auto_map'"):
        boost_compiler.from_pretrained(folder)
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["hf_config", "init_from"])
def test_train_refuses_auto_map_before_transformers_sees_it(tmp_path: Path, flag: str) -> None:
    """``boost train --hf-config/--init-from`` of a llama folder that also names code."""
    from boost_compiler.train import TrainConfig, train

    folder, marker = _remote_folder(tmp_path, model_type="llama")
    with pytest.raises(RemoteCodeError, match="auto_map"):
        train(TrainConfig(**{flag: str(folder)}, steps=1, compile=False, progress=False))
    assert not marker.exists()
