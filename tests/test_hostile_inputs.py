"""Hostile or damaged inputs refused by name, before anything expensive is built or any file
is changed: plan files with ``Infinity`` or nested a hundred thousand deep, configs whose
sizes the weight files refute (zero heads, a 2.5 TB embedding, a million layers), NaN
weights under an SVD, output folders holding another model or a training checkpoint,
``--data /dev/null``, a filesystem without ``flock``. One process, CPU, tiny models.
"""

from __future__ import annotations

import errno
import fcntl
import json
import time
from pathlib import Path

import pytest
import torch

from boost_compiler.errors import (
    ConversionError,
    DataError,
    HFFolderError,
    LayoutError,
    OutputPathError,
    PlanFileError,
    RunFolderError,
)
from boost_compiler.tp.plan import TPPlan
from tests.extras import need

# ---- 1, 2: plan files -----------------------------------------------------------------------

_PLAN = {"format": "boost-plan", "version": 1, "p": 2,
         "params": {"w": {"placement": "R", "shape": [4, 2]}}}  # fmt: skip


@pytest.mark.parametrize(
    "text, constant",
    [(json.dumps(_PLAN).replace('"p": 2', '"p": Infinity'), "Infinity"),
     (json.dumps(_PLAN).replace("[4, 2]", "[Infinity, 2]"), "Infinity"),
     (json.dumps(_PLAN).replace("[4, 2]", "[4, -Infinity]"), "-Infinity"),
     (json.dumps(_PLAN).replace('"p": 2', '"p": NaN'), "NaN")],
)  # fmt: skip
def test_a_plan_with_a_non_finite_number_is_named(tmp_path: Path, text: str, constant: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanFileError, match=f"{path}: {constant} is not a number a plan holds"):
        TPPlan.load(path)


def test_a_plan_nested_deeper_than_the_reader_follows_is_named(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"format": "boost-plan", "version": 1, "decisions": '
                    + "[" * 100_000 + "]" * 100_000 + "}")  # fmt: skip
    with pytest.raises(PlanFileError, match="nested deeper than Python's JSON reader follows"):
        TPPlan.load(path)


def test_a_saved_plan_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_PLAN))
    assert TPPlan.load(path).param_shapes == {"w": (4, 2)}


# ---- folders: a tiny Hugging Face Llama and the layouts' own folders --------------------------


def _hf_folder(folder: Path, layers: int = 2) -> Path:
    tf = need("transformers")
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=4, vocab_size=256)  # fmt: skip
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _layout_folder(layout: str, folder: Path) -> Path:
    need("transformers")
    need("safetensors")
    from tests.layout_refs import write_folder

    write_folder(layout, folder)
    return folder


def _edited(folder: Path, file: str = "config.json", **values: object) -> Path:
    config = json.loads((folder / file).read_text())
    config.update(values)
    (folder / file).write_text(json.dumps(config))
    return folder


def _from_pretrained(folder: Path):  # noqa: ANN202 (a transformers model)
    import boost_compiler

    return boost_compiler.from_pretrained(folder)


# ---- 3: a LORO folder in bf16 -----------------------------------------------------------------


def test_a_loro_folder_saved_in_bf16_loads_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from boost_compiler import layouts

    model = _from_pretrained(_layout_folder("loro", tmp_path / "loro")).to(torch.bfloat16)
    out = layouts.save(model, tmp_path / "bf16", "loro")
    saved = load_file(str(out / "model.safetensors"))
    assert saved["model.layers.0.self_attn.rotary_emb.inv_freq"].dtype == torch.bfloat16
    back = _from_pretrained(out)  # was: "other RoPE frequencies than rope_theta"
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in back.named_parameters())
    # As LORO's own code saves a model cast to bf16: every tensor bf16, its buffers too.
    whole = {k: v.to(torch.bfloat16) for k, v in load_file(str(tmp_path / "loro" /
                                                                "model.safetensors")).items()}  # fmt: skip
    save_file(whole, str(tmp_path / "loro" / "model.safetensors"))
    _from_pretrained(tmp_path / "loro")
    # Another RoPE is still another one at bf16's precision, and the message says the dtype.
    other = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    whole["model.layers.1.self_attn.rotary_emb.inv_freq"] = other.to(torch.bfloat16)
    save_file(whole, str(tmp_path / "loro" / "model.safetensors"))
    with pytest.raises(LayoutError, match=r"layers\.1\.self_attn\.rotary_emb\.inv_freq' "
                       r"\(torch\.bfloat16.*at torch\.bfloat16's precision"):  # fmt: skip
        _from_pretrained(tmp_path / "loro")


# ---- 4, 11, 12: configs the weight files refute ----------------------------------------------


@pytest.mark.parametrize("kind", ["hf", "loro"])
@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_key_value_heads", 0),
                                        ("num_attention_heads", -4), ("hidden_size", True)])  # fmt: skip
def test_a_size_that_is_not_a_positive_integer_is_named(
    tmp_path: Path, kind: str, key: str, value: object
) -> None:
    folder = _hf_folder(tmp_path / "m") if kind == "hf" else _layout_folder("loro", tmp_path / "m")
    _edited(folder, **{key: value})
    error = HFFolderError if kind == "hf" else LayoutError  # was: ZeroDivisionError
    with pytest.raises(error, match=f"config.json.*'{key}' is {value!r}; a size or count"):
        _from_pretrained(folder)


@pytest.mark.parametrize("kind", ["hf", "loro", "sltrain"])
@pytest.mark.parametrize("key, value", [("vocab_size", 10**10), ("hidden_size", 10**9)])
def test_a_size_beyond_all_the_weights_is_refused_before_allocating(
    tmp_path: Path, kind: str, key: str, value: int
) -> None:
    folder = (_hf_folder(tmp_path / "m") if kind == "hf"
              else _layout_folder(kind, tmp_path / "m"))  # fmt: skip
    _edited(folder, **{key: value})
    t0 = time.perf_counter()
    # was: RuntimeError: can't allocate memory (2.5 TB), or a 1 GB RoPE buffer and a wrong name
    with pytest.raises(HFFolderError, match=f"config.json.*{key} is {value:,}, more than all the "
                       "weight files"):  # fmt: skip
        _from_pretrained(folder)
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("kind", ["hf", "loro", "cola", "boost-nanotron"])
def test_a_million_layers_over_two_layers_of_weights_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    folder = (_hf_folder(tmp_path / "m") if kind == "hf"
              else _layout_folder(kind, tmp_path / "m"))  # fmt: skip
    file = "model_config.json" if kind == "boost-nanotron" else "config.json"
    _edited(folder, file, num_hidden_layers=1_000_000)
    t0 = time.perf_counter()
    with pytest.raises(HFFolderError, match="num_hidden_layers is 1,000,000, but the weight files "
                       r".* hold layers 0 to 1 only.*set num_hidden_layers to 2"):  # fmt: skip
        _from_pretrained(folder)  # was: a million layers built, over 280 s
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("kind", ["hf", "loro"])
def test_a_size_the_weights_do_not_have_names_the_tensor_and_the_key(
    tmp_path: Path, kind: str
) -> None:
    folder = _hf_folder(tmp_path / "m") if kind == "hf" else _layout_folder("loro", tmp_path / "m")
    _edited(folder, vocab_size=300)
    with pytest.raises(HFFolderError, match=r"'model\.embed_tokens\.weight' is \[256, 64\] in the "
                       r"files, \[300, 64\] in the model \(vocab_size 300\)"):  # fmt: skip
        _from_pretrained(folder)


def test_fitting_folders_still_load(tmp_path: Path) -> None:
    assert _from_pretrained(_hf_folder(tmp_path / "hf")).config.num_hidden_layers == 2
    for kind in ("loro", "boost-nanotron"):
        assert _from_pretrained(_layout_folder(kind, tmp_path / kind)).config.vocab_size == 256


# ---- 7: NaN under the SVD ------------------------------------------------------------------


def test_init_from_a_folder_holding_nan_names_the_tensor(tmp_path: Path) -> None:
    tf = need("transformers")
    import boost_compiler
    from boost_compiler.train import TrainConfig
    from boost_compiler.train.hf_model import build

    folder = _hf_folder(tmp_path / "nan")
    model = tf.LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
        model.model.layers[1].mlp.up_proj.weight[4, 6] = float("inf")
    model.save_pretrained(folder)
    want = (r"--init-from .*nan: 'model\.layers\.1\.mlp\.up_proj\.weight' \(128, 64\) holds 1 NaN "
            r"and 1 infinite value\(s\) \(the first at \(3, 5\)\): its SVD is undefined")  # fmt: skip
    with pytest.raises(ConversionError, match=want):  # was: torch's _LinAlgError from the SVD
        build(TrainConfig(init_from=str(folder)))
    # to_low_rank itself refuses before it replaces any module (layer 0 comes first)
    with pytest.raises(ConversionError, match="up_proj.weight"):
        boost_compiler.to_low_rank(model, method="svd", rank_ratio=0.25)
    assert not any(isinstance(m, boost_compiler.LowRankLinear) for m in model.modules())


# ---- 8, 9: boost explain ---------------------------------------------------------------------


def test_explain_out_naming_a_file_is_refused_before_the_capture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boost_compiler.cli import main
    from boost_compiler.explain import explain

    file = tmp_path / "report"
    file.write_text("not a folder")
    assert main(["explain", "cola-llama:tiny", "--out", str(file)]) == 2  # was: FileExistsError
    assert f"--out (out_dir) {file} is a file: the report is a folder" in capsys.readouterr().err
    with pytest.raises(OutputPathError, match=r"is under .*report, a file"):
        explain(torch.nn.Linear(2, 2), (torch.randn(1, 2),), out_dir=file / "sub")
    assert file.read_text() == "not a folder"


def test_explain_of_a_folder_whose_config_its_weights_refute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boost_compiler.cli import main

    folder = _edited(_hf_folder(tmp_path / "hf"), hidden_size=10**9)
    # was: "pass 'group_linears' failed: KeyError" after a capture at that width
    assert main(["explain", str(folder), "--out", str(tmp_path / "report")]) == 2
    assert "hidden_size is 1,000,000,000, more than all the weight files (model.safetensors)" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "report").exists()


# ---- 5, 6: output folders ----------------------------------------------------------------


def test_a_layout_exported_over_another_one_is_refused_then_replaced(tmp_path: Path) -> None:
    from boost_compiler import layouts

    sltrain = _from_pretrained(_layout_folder("sltrain", tmp_path / "sl"))
    loro = _from_pretrained(_layout_folder("loro", tmp_path / "lo"))
    out = layouts.save(sltrain, tmp_path / "out", "sltrain")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "README.md").write_text("kept")
    with pytest.raises(LayoutError, match=r"out: not empty \(it holds README\.md, config\.json, "
                       r"model\.safetensors, splora_config\.json\).*overwrite=True"):  # fmt: skip
        layouts.save(loro, out, "loro")  # was: written, then "missing keys" on read (stale splora)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "README.md"} == before
    layouts.save(loro, out, "loro", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                     "model.safetensors"]  # fmt: skip
    assert layouts.detect(out) == "loro"
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(_from_pretrained(out)(ids).logits, loro.eval()(ids).logits)
    # Nanotron's tree is among the files an overwrite replaces
    nano = _from_pretrained(_layout_folder("boost-nanotron", tmp_path / "nt"))
    layouts.save(nano, out, "boost-nanotron", overwrite=True)
    assert layouts.detect(out) == "boost-nanotron"
    layouts.save(loro, out, "loro", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                     "model.safetensors"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step ``--hf-config`` training run's folder (one process, no compile)."""
    from boost_compiler.train import TrainConfig, train

    root = tmp_path_factory.mktemp("run")
    hf = _hf_folder(root / "hf", layers=1)
    train(TrainConfig(hf_config=str(hf), steps=1, batch=2, seq=16, warmup=0,
                      checkpoint_dir=str(root / "ckpt"), compile=False, progress=False))  # fmt: skip
    return root / "ckpt"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_into_a_training_checkpoint_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boost_compiler.cli import main
    from boost_compiler.train.hf_model import export_hf, export_layout

    step = run / "step_1"
    before = _tree(run)
    argv = ["export", "--checkpoint", str(step), "--format", "hf", "--overwrite"]
    assert main([*argv, str(step)]) == 2  # was: written, and the checkpoint failed its manifest
    assert f"{step}: a training checkpoint's folder (it holds .metadata, train_state.json)" in (
        capsys.readouterr().err
    )
    assert main([*argv, str(step / "hf")]) == 2
    assert "(" + str(step) + ", a folder above it, holds" in capsys.readouterr().err
    with pytest.raises(HFFolderError, match="a training run's folder"):
        export_hf(run, run, overwrite=True)
    with pytest.raises(LayoutError, match="a training checkpoint's folder"):
        export_layout(step, step, "cola", overwrite=True)
    assert _tree(run) == before
    assert main(["export", "--checkpoint", str(run), "--format", "hf", str(tmp_path / "o")]) == 0


def test_a_metadata_file_above_an_output_folder_is_no_checkpoint(tmp_path: Path) -> None:
    """``.metadata`` is a common name: above the output folder it marks a checkpoint only in
    a ``step_N`` folder (or beside train_state.json), not in a user's home or project."""
    from boost_compiler.output_folder import training_folder

    (tmp_path / ".metadata").write_text("some other tool's")
    assert training_folder(tmp_path / "export") is None
    assert training_folder(tmp_path) is not None  # the folder itself: still refused
    step = tmp_path / "run" / "step_3"
    step.mkdir(parents=True)
    (step / ".metadata").write_text("dcp")
    assert "step_3, a folder above it, holds .metadata" in str(training_folder(step / "hf"))


def test_export_into_a_non_empty_folder_needs_overwrite(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boost_compiler.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "model_config.json").write_text("{}")  # another layout's file (Nanotron's)
    argv = ["export", "--checkpoint", str(run), "--format", "hf", str(out)]
    assert main(argv) == 2
    assert "not empty (it holds model_config.json)" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert not (out / "model_config.json").exists()
    assert _from_pretrained(out).config.num_hidden_layers == 1


# ---- 10: --data that is no regular file ---------------------------------------------------


def test_data_that_is_not_a_regular_file_says_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from boost_compiler.cli import main
    from boost_compiler.train.stream import resolve_files

    if Path("/dev/null").exists():  # a character device on every POSIX system
        argv = ["train", "--data", "/dev/null", "--steps", "1", "--no-compile", "--no-progress",
                "--checkpoint-dir", str(tmp_path / "run")]  # fmt: skip
        assert main(argv) == 2  # was: "no such file or folder" for a path that exists
        assert "--data /dev/null: a character device, not a regular file" in capsys.readouterr().err
        assert not (tmp_path / "run").exists()  # refused with the flags, before the run folder
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.txt: the file is empty \(0 bytes\)"):
        resolve_files([str(empty)], "--data")
    link = tmp_path / "gone.txt"
    link.symlink_to(tmp_path / "missing.txt")
    with pytest.raises(DataError, match=r"gone\.txt: a link to .*missing\.txt, which does not"):
        resolve_files([str(link)], "--eval-data")
    with pytest.raises(DataError, match="no such file or folder"):
        resolve_files([str(tmp_path / "nope.txt")])


# ---- 13: a filesystem without flock --------------------------------------------------------


def test_a_filesystem_without_flock_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:  # fmt: skip
    from boost_compiler.train.run_folder import LOCK_FILE, RunLock

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(RunFolderError, match=r"cannot lock .*\.lock \(ENOSYS: Function not "
                       r"implemented\): its filesystem does not support flock"):  # fmt: skip
        RunLock.acquire(tmp_path)  # was: the raw OSError
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("lost", ["the last shard", "the shards of the last layer"])
def test_a_sharded_folder_missing_a_shard_names_the_file(tmp_path: Path, lost: str) -> None:
    """An interrupted download: the index names shards that are not there. Was: a bare
    FileNotFoundError from transformers, or, for the shards of the last layer, "the config
    counts layers the weights lack: set num_hidden_layers to 1", advice that would load
    a truncated model."""
    tf = need("transformers")
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, vocab_size=256)  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path / "m"
    tf.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    if lost == "the last shard":
        gone = [max(weight_map.values())]
    else:
        gone = sorted({f for k, f in weight_map.items() if ".layers.1." in k})
        assert all(".layers.1." not in k for k, f in weight_map.items() if f not in gone)
    for name in gone:
        (folder / name).unlink()
    with pytest.raises(HFFolderError, match=f"not in the folder: {gone[0]}") as info:
        _from_pretrained(folder)
    assert "set num_hidden_layers" not in str(info.value)
