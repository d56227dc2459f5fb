"""What a user sees during training: tokens/s and MFU in the bar and the metrics, TensorBoard.

Single process and eager (``compile=False``); TensorBoard through a fake
``torch.utils.tensorboard`` module when the package is absent (the real one too when present).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from boost_compiler import costmodel
from boost_compiler.errors import TrainConfigError
from boost_compiler.models import cola_llama as cola
from boost_compiler.train import loop, mfu, report
from boost_compiler.train.config import TrainConfig, add_arguments, from_args
from tests.extras import need

RUN = {"steps": 2, "batch": 2, "seq": 16, "warmup": 1, "compile": False, "progress": False,
       "log_every": 100}  # fmt: skip


def _hand_params(c: cola.ColaLlamaConfig) -> int:
    """Elements of the tiny CoLA-LLaMA's weight matrices, from its sizes (not its modules)."""
    d, f, r, hd = c.d_model, c.d_ff, c.rank, c.head_dim
    q, kv = c.n_heads * hd, c.num_kv_heads * hd
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]  # q k v o gate up down
    per_layer = sum(r * (d_in + d_out) for d_in, d_out in shapes)  # down d_in x r, up r x d_out
    return c.n_layers * per_layer + d * c.vocab_size  # + the untied LM head; no embedding


def test_flops_per_token_matches_a_hand_count() -> None:
    model = cola.build("tiny", seed=0)
    c, seq = model.cfg, 16
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    params = mfu.matmul_params(shapes, {}, mfu.embedding_weights(model))
    assert params == _hand_params(c)
    assert mfu.attention_dims(model) == (c.n_layers, c.d_model)
    flops = mfu.flops_per_token(params, c.n_layers, c.d_model, seq)
    assert flops == 6 * _hand_params(c) + 12 * c.n_layers * c.d_model * seq
    # The docstring's claim: 6 P is the cost model's BTP GEMMs (forward 2MKN per rank, tp=1,
    # one token) times three for the backward, plus the LM head's 6 d V.
    layer = costmodel.cost(costmodel.LlamaDims.from_model_config(c), tp=1, batch=1, seq=1)
    gemm = sum(g.flops for g in layer.strategies["btp"].gemms)
    assert 6 * params == 3 * gemm * c.n_layers + 6 * c.d_model * c.vocab_size
    # MFU: 1,000 tokens/s on 2 devices of 0.5 TFLOP/s each.
    got = mfu.mfu(1000.0, flops, devices=2, peak_tflops=0.5)
    assert got == pytest.approx(flops * 1000.0 / (2 * 0.5e12), rel=1e-12)
    assert mfu.mfu(1000.0, flops, devices=2, peak_tflops=None) is None


def test_tied_and_positional_embeddings() -> None:
    shapes = {"wte.weight": (100, 8), "wpe.weight": (32, 8), "h.0.w": (8, 8), "ln.weight": (8,)}
    emb = {"wte.weight", "wpe.weight", "lm_head.weight"}
    # Untied: neither table is a GEMM (a separate head would be its own entry).
    assert mfu.matmul_params(shapes, {}, emb) == 64
    # Tied to a head that is not an embedding: counted once, as the head.
    head = emb - {"lm_head.weight"}
    assert mfu.matmul_params(shapes, {"lm_head.weight": "wte.weight"}, head) == 864


def test_attention_dims_of_a_transformers_config() -> None:
    model = torch.nn.Module()
    model.config = types.SimpleNamespace(  # type: ignore[assignment]
        model_type="llama",
        num_hidden_layers=3,
        num_attention_heads=4,
        hidden_size=64,
        head_dim=None,
    )
    assert mfu.attention_dims(model) == (3, 64)
    model.config.head_dim = 32  # Qwen3-style: heads x head_dim != hidden_size
    assert mfu.attention_dims(model) == (3, 128)
    assert mfu.attention_dims(torch.nn.Linear(2, 2)) is None


def test_peak_table_and_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert mfu.known_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert mfu.known_peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert mfu.known_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert mfu.known_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert mfu.known_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert mfu.known_peak_tflops("NVIDIA L40S", "bf16") == 362.0  # not the L4's 121
    assert mfu.known_peak_tflops("Some Future GPU", "bf16") is None

    cpu = mfu.resolve_peak(None, torch.device("cpu"), bf16=False)
    assert cpu.tflops is None and "--peak-tflops" in cpu.source
    assert mfu.resolve_peak(2.5, torch.device("cpu"), bf16=False).tflops == 2.5
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(TrainConfigError, match="--peak-tflops"):
            mfu.resolve_peak(bad, torch.device("cpu"), bf16=False)
    # A CUDA device is named by torch.cuda.get_device_name (no GPU needed to ask the table).
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = mfu.resolve_peak(None, torch.device("cuda", 0), bf16=True)
    assert gpu.tflops == 989.4 and "bf16" in gpu.source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert mfu.resolve_peak(None, torch.device("cuda", 0), bf16=True).tflops is None


def test_flags_parse() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--peak-tflops", "312", "--tensorboard"]))
    assert cfg.peak_tflops == 312.0 and cfg.tensorboard
    cfg = from_args(p.parse_args([]))
    assert cfg.peak_tflops is None and not cfg.tensorboard


def test_step_description() -> None:
    assert report.step_description(2.5, 12345.6, 0.4567) == "loss 2.5000 | 12,346 tok/s | MFU 45.7%"
    assert report.step_description(2.5, 100.0, None).endswith("MFU n/a")


class _FakeProgress:
    """Stands in for rich's Progress: records each step's description."""

    def __init__(self) -> None:
        self.descriptions: list[str] = []

    def __enter__(self) -> _FakeProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, task: int, advance: int = 0, description: str = "") -> None:
        self.descriptions.append(description)


def _train(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[list[dict[str, Any]], list[str]]:
    bar = _FakeProgress()
    monkeypatch.setattr(loop, "progress_bar", lambda enabled, total, start: (bar, 0))
    loop.train(TrainConfig(**{**RUN, **kw}))
    lines = Path(kw["metrics"]).read_text().splitlines()
    return [json.loads(line) for line in lines], bar.descriptions


def test_metrics_carry_tokens_per_s_and_mfu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = time.perf_counter()
    records, bar = _train(monkeypatch, metrics=str(tmp_path / "m.jsonl"), peak_tflops=1e-3)
    wall = time.perf_counter() - t0
    start, steps = records[0], [r for r in records if "loss" in r]
    flops = start["flops_per_token"]
    # tokens/s from what the test knows, not from the trainer's own figures: a step is
    # batch x seq tokens (RUN: 2 x 16), and the steps fit inside the call's wall time
    tokens = RUN["batch"] * RUN["seq"]
    for rec in steps:
        assert rec["tokens_per_s"] * rec["step_s"] == pytest.approx(tokens, rel=1e-9)
        assert rec["tokens_seen"] == (rec["step"] + 1) * tokens
    assert 0 < sum(r["step_s"] for r in steps) <= wall
    assert start["peak_tflops_per_device"] == 1e-3 and start["mfu_devices"] == 1
    assert flops == 6 * _hand_params(cola.CONFIGS["tiny"]) + 12 * 2 * 64 * 16
    assert [r["step"] for r in steps] == [0, 1]
    for rec in steps:
        assert rec["tokens_per_s"] > 0
        assert rec["mfu"] == pytest.approx(flops * rec["tokens_per_s"] / 1e9, rel=1e-9)
    assert all("MFU" in d and "n/a" not in d for d in bar)


def test_cpu_without_peak_is_na(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, bar = _train(monkeypatch, metrics=str(tmp_path / "m.jsonl"))
    assert records[0]["peak_tflops_per_device"] is None
    steps = [r for r in records if "loss" in r]
    assert steps and all(r["mfu"] is None and r["tokens_per_s"] > 0 for r in steps)
    assert len(bar) == 2 and all(d.endswith("MFU n/a") and "tok/s" in d for d in bar)


class _FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's surface the trainer uses, recorded."""

    made: list[_FakeWriter] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step = Path(log_dir), purge_step
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        self.log_dir.mkdir(parents=True, exist_ok=True)  # as the real writer does
        (self.log_dir / "events.out.tfevents.fake").write_text("")
        _FakeWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _fake_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeWriter.made = []
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _FakeWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


def test_tensorboard_receives_the_scalars_under_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_tensorboard(monkeypatch)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run = tmp_path / "run"
    _train(monkeypatch, metrics=str(run / "metrics.jsonl"), tensorboard=True, peak_tflops=1e-3)
    (writer,) = _FakeWriter.made
    assert writer.log_dir == run / "tensorboard" and writer.purge_step == 0 and writer.closed
    tags = {tag for tag, _, _ in writer.scalars}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu"} <= tags
    assert sorted(s for tag, _, s in writer.scalars if tag == "train/loss") == [0, 1]
    # Nothing outside the run folder: the working directory and tmp_path hold only it.
    assert not _files(cwd)
    assert {p.parts[0] for p in _files(tmp_path)} == {"run"}
    assert all(p.parts[0] == "tensorboard" or p.parent == Path(".") for p in _files(run))
    # Eval records (what --eval-* writes) reach it too; a missing MFU is not a scalar.
    board = report.TensorBoard(run / "tensorboard", _FakeWriter)
    board.add({"event": "start", "step": 5})
    board.add({"step": 5, "loss": 1.0, "lr": 0.1, "tokens_per_s": 10.0, "mfu": None})
    board.add({"event": "eval", "step": 5, "eval_loss": 2.0, "eval_ppl": math.exp(2.0)})
    board.close()
    resumed = _FakeWriter.made[-1]
    assert resumed.purge_step == 5  # a resumed run hides what the crashed one logged later
    assert ("eval/loss", 2.0, 5) in resumed.scalars and ("train/loss", 1.0, 5) in resumed.scalars
    assert "train/mfu" not in {tag for tag, _, _ in resumed.scalars}


def test_real_tensorboard_writes_event_files(tmp_path: Path) -> None:
    """The real SummaryWriter (the tensorboard extra, installed by dev.sh), read back."""
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainConfig(checkpoint_dir=str(tmp_path / "run"), tensorboard=True)
    board = report.open_tensorboard(cfg, enabled=True)
    assert board is not None
    record = {"step": 3, "loss": 1.25, "lr": 0.1, "grad_norm": 0.75, "tokens_per_s": 10.0,
              "mfu": 0.5}  # fmt: skip
    board.add(record)
    board.close()
    (events,) = (tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    for key, tag in report.STEP_SCALARS.items():
        (scalar,) = acc.Scalars(tag)
        assert (scalar.step, scalar.value) == (3, pytest.approx(record[key])), tag
    assert set(report.STEP_SCALARS.values()) == {"train/loss", "train/lr", "train/grad_norm",
                                                 "train/tokens_per_s", "train/mfu"}  # fmt: skip


def test_missing_tensorboard_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    cfg = TrainConfig(**RUN, metrics=str(tmp_path / "run" / "m.jsonl"), tensorboard=True)
    with pytest.raises(TrainConfigError, match=r"pip install 'boost-compiler\[tensorboard\]'"):
        report.open_tensorboard(cfg, enabled=True)
    with pytest.raises(TrainConfigError, match=r"boost-compiler\[tensorboard\]"):
        loop.train(cfg)  # before any work: no model built, nothing written
    assert not (tmp_path / "run").exists()
    # Without the flag the package is never imported.
    assert report.open_tensorboard(TrainConfig(), enabled=True) is None


def test_tensorboard_needs_a_run_folder() -> None:
    _FakeWriter.made = []
    with pytest.raises(TrainConfigError, match="--checkpoint-dir"):
        report.open_tensorboard(TrainConfig(tensorboard=True), enabled=True)
