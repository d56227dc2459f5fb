"""Other projects' low-rank checkpoints in and out (issue 30, item 1). CPU, gloo, eager.

For each layout (CoLA, CoLA-M, LORO, SLTrain, the BOOST reference's Nanotron): a tiny
folder written here in the layout's own key names, shapes and files (random weights,
``tests/layout_refs.py``) is detected, imports with ``boost_compiler.from_pretrained``,
and its logits equal the layout's own forward written from its published math (float64)
within 1e-5; written back (``boost_compiler.layouts.save``) it has the same files, keys,
shapes and dtypes, and the layout's forward on it gives the same logits. In one 2-process
world, each imported model trains 3 SGD steps at tp=2 against one device: logits, loss,
gathered gradients and parameters within 1e-5 on every rank, no fallback. ``boost train
--init-from DIR --layout sltrain`` then ``boost export --format sltrain`` round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.extras import need

need("transformers")
need("safetensors")

import boost_compiler  # noqa: E402
from boost_compiler import layouts  # noqa: E402
from boost_compiler.errors import LayoutError  # noqa: E402
from boost_compiler.hf_io import write_folder as write_hf_folder  # noqa: E402
from tests.layout_refs import (  # noqa: E402
    LAYOUTS,
    RANK,
    VOCAB,
    read_folder,
    reference_logits,
    write_folder,
)
from tests.tp_harness import RTOL, ranks, result_of, run_world  # noqa: E402

IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max()).item()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    for layout in LAYOUTS:
        write_folder(layout, root / layout)
    return {layout: root / layout for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_folder_is_detected(folders: dict[str, Path], layout: str) -> None:
    assert layouts.detect(folders[layout]) == layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_equals_the_layouts_forward_and_exports_back(
    folders: dict[str, Path], layout: str, tmp_path: Path
) -> None:
    folder = folders[layout]
    model = boost_compiler.from_pretrained(folder)
    want = reference_logits(layout, folder, IDS)
    err = _rel(_logits(model), want)
    print(f"{layout}: import vs the layout's forward {err:.2e}")
    assert err <= RTOL
    pairs = {n for n, m in model.named_modules() if isinstance(m, boost_compiler.LowRankLinear)}
    assert len(pairs) == 14 and all(m.rank == RANK for n, m in model.named_modules() if n in pairs)

    out = layouts.save(model, tmp_path / "out", layout)
    src_cfg, src = read_folder(folder)
    out_cfg, back = read_folder(out)
    assert out_cfg == src_cfg  # the layout's own config files, as they were read
    assert {k: (v.shape, v.dtype) for k, v in back.items()} == {
        k: (v.shape, v.dtype) for k, v in src.items()
    }
    for key, t in src.items():  # transposes and renames are exact; SLTrain's A / scale: an ulp
        if layout == "sltrain" and key.endswith("lora_A"):
            torch.testing.assert_close(back[key], t, rtol=1e-6, atol=0, msg=key)
        else:
            assert torch.equal(back[key], t), key
    assert _rel(reference_logits(layout, out, IDS), want) <= RTOL
    assert layouts.detect(out) == layout
    assert _rel(_logits(boost_compiler.from_pretrained(out)), want) <= RTOL
    # and as boost's own Hugging Face folder (SLTrain's sparse part recorded in config.json)
    config = json.loads(model.config.to_json_string(use_diff=False))
    hf = write_hf_folder(tmp_path / "hf", config, model.state_dict())
    assert layouts.detect(hf) is None
    assert torch.equal(_logits(boost_compiler.from_pretrained(hf)), _logits(model))


def test_nanotron_interleaved_rope_is_permuted_exactly(tmp_path: Path) -> None:
    """rope_interleaved (GPT-J pairs): q and k up factors' rows permuted per head on import,
    back on export (nanotron's convert_nanotron_to_hf.py does it for dense weights)."""
    write_folder("boost-nanotron", tmp_path / "nt", rope_interleaved=True)
    model = boost_compiler.from_pretrained(tmp_path / "nt")
    want = reference_logits("boost-nanotron", tmp_path / "nt", IDS)
    assert _rel(_logits(model), want) <= RTOL
    out = layouts.save(model, tmp_path / "out", "boost-nanotron")
    src, back = read_folder(tmp_path / "nt")[1], read_folder(out)[1]
    assert all(torch.equal(back[k], t) for k, t in src.items())


@pytest.fixture(scope="module")
def trained(folders: dict[str, Path]) -> dict:
    checks = [(lay, "tests.layout_checks:train_layout", (lay, str(folders[lay])))
              for lay in LAYOUTS]  # fmt: skip
    return run_world(2, checks)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trains_at_tp2_exactly_without_fallback(trained: dict, layout: str) -> None:
    res = result_of(trained, layout)
    for r in ranks(res):
        print(layout, r["rank"], {k: r[k] for k in ("logits", "loss", "grad", "param")})
        assert r["fallbacks"] == [], r["fallbacks"]
        assert {f"model.layers.{i}.{p}" for i in range(2) for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} <= set(r["pairs_split"])  # fmt: skip
        for what in ("logits", "loss", "grad", "param"):
            assert r[what] <= RTOL, (what, r[what])


def test_train_init_from_a_layout_and_export_it_back(folders: dict[str, Path],
                                                     tmp_path: Path) -> None:  # fmt: skip
    """``boost train --init-from DIR --layout sltrain`` (one process), then ``boost export
    --format sltrain``: the same files, keys and shapes, other values (it trained), and the
    layout's own forward on them equals the exported folder imported again."""
    from boost_compiler.cli import main

    run = tmp_path / "run"
    argv = ["train", "--init-from", str(folders["sltrain"]), "--layout", "sltrain", "--steps",
            "2", "--batch", "2", "--seq", "16", "--warmup", "1", "--no-compile", "--no-progress",
            "--checkpoint-dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(run), "--format", "sltrain", str(out)]) == 0
    (src_cfg, src), (out_cfg, back) = read_folder(folders["sltrain"]), read_folder(out)
    assert out_cfg == src_cfg
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in src.items()}
    key = "model.layers.0.self_attn.q_proj"
    assert torch.equal(back[f"{key}.sparse_index"], src[f"{key}.sparse_index"])  # support kept
    assert not torch.equal(back[f"{key}.sparse_value"], src[f"{key}.sparse_value"])  # trained
    want = reference_logits("sltrain", out, IDS)
    assert _rel(_logits(boost_compiler.from_pretrained(out)), want) <= RTOL


def test_what_a_layout_cannot_hold_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    import transformers as tf
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    write_folder("cola", bad)
    weights = load_file(str(bad / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.cola_b"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.mlp\.up_proj\.cola_b"):
        boost_compiler.from_pretrained(bad)
    with pytest.raises(LayoutError, match="unknown layout"):
        boost_compiler.from_pretrained(bad, layout="galore")
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    svd, cola = tf.LlamaForCausalLM(config), tf.LlamaForCausalLM(config)
    with pytest.raises(LayoutError, match="no low-rank projections"):
        layouts.save(svd, tmp_path / "d", "loro")
    boost_compiler.to_low_rank(svd, method="svd", rank=16)
    boost_compiler.to_low_rank(cola, method="cola", rank=16)
    with pytest.raises(LayoutError, match="q_proj' has activation None"):
        layouts.save(svd, tmp_path / "a", "cola")
    with pytest.raises(LayoutError, match="grouped-query"):  # CoLA: k/v onto every head
        layouts.save(cola, tmp_path / "c", "cola-m")
    with pytest.raises(LayoutError, match="lacks a sparse part"):
        layouts.save(svd, tmp_path / "s", "sltrain")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folders["loro"] / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(LayoutError, match="safetensors"):
        boost_compiler.from_pretrained(pickled, layout="loro")


@pytest.mark.parametrize(
    "config", [{"rope_theta": None}, {"rope_parameters": {"rope_type": "default"}}]
)
def test_a_null_rope_base_is_named_not_assumed(config: dict) -> None:
    """A config that writes no RoPE base (null, or transformers 5's ``rope_parameters``
    without one) cannot be checked against the layout's fixed base: a LayoutError, not a
    TypeError and not a guess."""
    from boost_compiler.layouts.base import Converted, require_rope

    with pytest.raises(LayoutError, match="rope_theta null"):
        require_rope(Converted(config, {}), "loro", 10000.0)
