"""Hugging Face models in and out of ``boost train`` (issue 18, part 2). CPU, gloo, eager.

* ``--init-from``: a tiny dense ``LlamaForCausalLM`` saved with ``save_pretrained``, trained
  3 steps at tp=2 by ``boost train --init-from DIR`` (SVD-factored at start), exported with
  ``boost export --format hf``, loaded by ``boost_compiler.from_pretrained`` in this
  process: its logits equal the trained, parallelized model's own (computed on both ranks
  right after ``train`` returned) within 1e-5 relative, and ``generate()`` runs. Step 0's
  loss equals that of the dense model SVD-factored here (so the weights were loaded, not
  drawn).
* ``--hf-config``: a tiny Qwen2 ``config.json`` folder (q/k/v biases, no weights), 2 steps
  at tp=2, CoLA factors: finite, decreasing loss; the checkpoint records the layout.
* The folder format: ``config.json``'s ``boost_low_rank``; a layout or weights that do
  not fit raise ``HFFolderError``; a wrong activation in the layout changes the logits
  beyond the tolerance the round trip is held to (the comparison can fail).

Ranks are forks of a forkserver that imported torch, transformers and the trainer once
(as in tests/test_train.py), with torchrun's environment variables; each runs the real
``boost train`` command line (``boost_compiler.cli.main``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.extras import need

need("transformers")
need("safetensors")

import transformers as tf  # noqa: E402

import boost_compiler  # noqa: E402
from boost_compiler.cli import main as cli_main  # noqa: E402
from boost_compiler.errors import HFFolderError  # noqa: E402
from boost_compiler.hf_io import LOW_RANK_KEY  # noqa: E402
from boost_compiler.train import read_metrics  # noqa: E402

TIMEOUT = 900  # seconds per launch: the CI cores are shared
RTOL = 1e-5
COMMON = ["--batch", "4", "--seq", "32", "--warmup", "1", "--no-compile", "--no-progress",
          "--log-every", "100", "--tp", "2"]  # fmt: skip
# Tiny, but every factor's rank (ratio 0.25, multiple of 8) divides by tp=2, and the
# vocabulary holds the byte tokens of the embedded corpus.
DIMS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
)  # fmt: skip
PROBE_SEED = 11  # the ids both the ranks and the exported model are run on


def _probe_ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(PROBE_SEED))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _start(run: Path) -> tuple[int, int, bool, int]:
    """(dp, tp, compile, tp collective bytes per step) from a run's metrics start record."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rec = next(r for r in map(json.loads, lines) if r.get("event") == "start")
    return rec["dp"], rec["tp"], rec["compile"], rec["tp_collective_bytes_per_step"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, argv: list[str], log: str, probe: str) -> None:
    """One rank: ``boost train ARGV``, then the trained model's logits on the probe ids.

    The process group is made here, before the command runs, so that ``train`` leaves it
    alive: the parallelized model it returns is then still callable (its forward runs
    collectives), and its output logits are global tensors.
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    from boost_compiler.cli import main
    from boost_compiler.train import loop

    loop.init_distributed()
    real_train = loop.train

    def train_and_probe(cfg: Any) -> Any:
        result = real_train(cfg)
        ids = _probe_ids()
        with torch.no_grad():  # the training call's signature: the graph it already has
            out = result.model(ids, labels=ids, use_cache=False)
        if rank == 0:
            torch.save({"logits": out.logits.detach().clone(), "loss": float(out.loss)}, probe)
        return result

    loop.train = train_and_probe  # what `boost train` calls (imported when it runs)
    code = main(["train", *argv])
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "transformers", "boost_compiler.train.loop"])


class Launch:
    """Two ranks of ``boost train`` (see :func:`_rank_main`)."""

    def __init__(self, logdir: Path, argv: list[str]) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        self.logs = [logdir / f"rank{r}.log" for r in range(2)]
        self.probe = logdir / "probe.pt"
        self.procs = [
            _CTX.Process(target=_rank_main,
                         args=(r, 2, port, argv, str(self.logs[r]), str(self.probe)))
            for r in range(2)
        ]  # fmt: skip
        for p in self.procs:
            p.start()

    def wait(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        for p in self.procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        bad = [r for r, p in enumerate(self.procs) if p.exitcode != 0]
        if bad:
            tails = "\n".join(f"--- rank {r}:\n{self.logs[r].read_text()[-3000:]}" for r in bad)
            raise AssertionError(f"ranks {bad} failed:\n{tails}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dense = tf.LlamaForCausalLM(tf.LlamaConfig(**DIMS))
    dense.save_pretrained(tmp / "dense")
    qwen = tmp / "qwen2-config"
    tf.Qwen2Config(**DIMS).save_pretrained(qwen)  # config.json only: no weights
    t0 = time.monotonic()
    launches = {
        "init": Launch(tmp / "init", [
            *COMMON, "--init-from", str(tmp / "dense"), "--steps", "3",
            "--checkpoint-dir", str(tmp / "init" / "ckpt"),
            "--metrics", str(tmp / "init" / "metrics.jsonl"),
        ]),
        "config": Launch(tmp / "config", [
            *COMMON, "--hf-config", str(qwen), "--steps", "2", "--lr", "1e-2",
            "--checkpoint-dir", str(tmp / "config" / "ckpt"),
            "--metrics", str(tmp / "config" / "metrics.jsonl"),
        ]),
    }  # fmt: skip
    timings = {}
    for name, launch in launches.items():
        launch.wait()
        timings[name] = round(time.monotonic() - t0, 1)
    print("run timings (s, since start):", timings)
    out = tmp / "exported"
    assert (
        cli_main(["export", "--checkpoint", str(tmp / "init" / "ckpt"), "--format", "hf", str(out)])
        == 0
    )
    return {"tmp": tmp, "out": out, "probe": torch.load(tmp / "init" / "probe.pt")}


def test_export_round_trip_logits(runs: dict[str, Any]) -> None:
    """from_pretrained(export) on one process == the trained tp=2 model, within 1e-5."""
    model = boost_compiler.from_pretrained(runs["out"])
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    ids = _probe_ids()
    with torch.no_grad():
        got = model(ids, labels=ids).logits
    want = runs["probe"]["logits"]
    err = _rel(got, want)
    print(f"exported vs trained tp=2 logits: max rel error {err:.1e}")
    assert got.shape == want.shape == (2, 32, 256)
    assert err < RTOL


def test_generate_works(runs: dict[str, Any]) -> None:
    model = boost_compiler.from_pretrained(runs["out"])
    prompt = torch.tensor([[10, 20, 30, 40]])
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9) and torch.equal(out[:, :4], prompt)
    assert int(out.max()) < 256


def test_init_from_loads_the_weights_and_trains(runs: dict[str, Any]) -> None:
    """Step 0's loss is the SVD-factored dense model's on step 0's batch; then it trains."""
    from boost_compiler.train.data import load_corpus

    tmp = runs["tmp"]
    losses = {s: r["loss"] for s, r in read_metrics(tmp / "init" / "metrics.jsonl").items()}
    assert sorted(losses) == [0, 1, 2]
    assert _start(tmp / "init")[:3] == (1, 2, False)  # dp, tp, compiled: the layout asked for
    dense = boost_compiler.from_pretrained(tmp / "dense")
    boost_compiler.to_low_rank(dense, method="svd", rank_ratio=0.25, multiple_of=8)
    ids = load_corpus(None).global_batch(0, 4, 32, 0)
    with torch.no_grad():
        want = dense(ids, labels=ids).loss.item()
    err = abs(losses[0] - want) / want
    print(f"step 0 loss {losses[0]:.6f}, SVD-factored dense model {want:.6f} (rel {err:.1e})")
    assert err < 1e-4
    assert losses[2] < losses[0]


def test_config_json_records_the_layout(runs: dict[str, Any]) -> None:
    config = json.loads((runs["out"] / "config.json").read_text())
    layout = config[LOW_RANK_KEY]
    assert layout["format"] == 1 and layout["method"] == "svd"
    mods = layout["modules"]
    assert len(mods) == 2 * 7  # q, k, v, o, gate, up, down in each layer; lm_head dense
    assert mods["model.layers.0.self_attn.q_proj"] == {
        "in_features": 64, "out_features": 64, "rank": 16, "bias": False, "activation": None,
    }  # fmt: skip
    assert mods["model.layers.1.self_attn.k_proj"]["rank"] == 8  # min(64, 32) / 4
    assert mods["model.layers.1.mlp.down_proj"]["in_features"] == 128
    assert "lm_head" not in mods
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "auto_map" not in config  # nothing for transformers to import from the folder
    names = sorted(p.name for p in runs["out"].iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]


def test_hf_config_trains_qwen2(runs: dict[str, Any]) -> None:
    tmp = runs["tmp"] / "config"
    losses = {s: r["loss"] for s, r in read_metrics(tmp / "metrics.jsonl").items()}
    print("qwen2 --hf-config losses:", losses)
    assert sorted(losses) == [0, 1]
    dp, tp, compiled, tp_bytes = _start(tmp)
    assert (dp, tp, compiled) == (1, 2, False) and tp_bytes > 0  # BTP's collectives ran
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[1] < losses[0]
    state = json.loads((tmp / "ckpt" / "step_2" / "train_state.json").read_text())
    record = state["hf_model_config"]
    assert record["model_type"] == "qwen2" and record[LOW_RANK_KEY]["method"] == "cola"
    q = record[LOW_RANK_KEY]["modules"]["model.layers.0.self_attn.q_proj"]
    assert q["activation"] == "silu" and q["bias"] is True  # Qwen2's q/k/v biases


def _copy(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config[LOW_RANK_KEY]["modules"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_layout_that_does_not_fit_raises(runs: dict[str, Any], tmp_path: Path) -> None:
    out = runs["out"]
    dropped = _copy(out, tmp_path / "dropped",
                    lambda m: m.pop("model.layers.0.mlp.up_proj"))  # fmt: skip
    with pytest.raises(HFFolderError, match="do not fit"):  # factor weights are unexpected
        boost_compiler.from_pretrained(dropped)
    ranked = _copy(out, tmp_path / "ranked",
                   lambda m: m["model.layers.0.mlp.up_proj"].update(rank=24))  # fmt: skip
    with pytest.raises(HFFolderError, match="up_proj"):
        boost_compiler.from_pretrained(ranked)
    alien = _copy(out, tmp_path / "alien",
                  lambda m: m.update({"model.layers.9.mlp.up_proj": m["model.layers.0.mlp.up_proj"]}))  # fmt: skip
    with pytest.raises(HFFolderError, match="layers.9"):
        boost_compiler.from_pretrained(alien)


def test_the_comparison_catches_a_wrong_forward(runs: dict[str, Any], tmp_path: Path) -> None:
    """Weights loaded fine, one pair's forward wrong (CoLA's SiLU added): logits differ."""
    wrong = _copy(runs["out"], tmp_path / "silu",
                  lambda m: m["model.layers.1.self_attn.o_proj"].update(activation="silu"))  # fmt: skip
    model = boost_compiler.from_pretrained(wrong)
    ids = _probe_ids()
    with torch.no_grad():
        got = model(ids).logits
    assert _rel(got, runs["probe"]["logits"]) > 100 * RTOL


def test_no_code_runs_from_the_folder(runs: dict[str, Any], tmp_path: Path) -> None:
    """Pickled weights are not read, and loading cannot be asked to trust remote code."""
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(runs["out"] / "config.json", folder / "config.json")
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(HFFolderError, match="safetensors"):
        boost_compiler.from_pretrained(folder)
    with pytest.raises(HFFolderError, match="trust_remote_code"):
        boost_compiler.from_pretrained(runs["out"], trust_remote_code=True)


def test_docstring_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``boost_compiler.hf_io.from_pretrained``'s example, as written (the public
    ``boost_compiler.from_pretrained``, which also reads other projects' layouts, has its
    own, which tests/test_docstrings.py runs)."""
    from boost_compiler.hf_io import from_pretrained

    doc = from_pretrained.__doc__ or ""
    body = doc.split("::\n", 1)[1]
    lines = [line[8:] if line.strip() else "" for line in body.splitlines()]
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(lines), "from_pretrained-example", "exec"), {})
    assert (tmp_path / "tiny-low-rank" / "config.json").is_file()


def test_export_hf_of_a_cola_llama_run_says_why(tmp_path: Path) -> None:
    """The packaged CoLA-LLaMA is no transformers model: --format hf names the way out."""
    from boost_compiler.train import TrainConfig, train
    from boost_compiler.train.hf_model import export_hf

    ckpt = tmp_path / "ckpt"
    train(TrainConfig(steps=1, batch=2, seq=16, warmup=0, checkpoint_dir=str(ckpt),
                      compile=False, progress=False, model_overrides={"n_layers": 1}))  # fmt: skip
    with pytest.raises(HFFolderError, match="--format safetensors"):
        export_hf(ckpt, tmp_path / "out")
    assert (
        cli_main(["export", "--checkpoint", str(ckpt), "--format", "hf", str(tmp_path / "o")]) == 2
    )
