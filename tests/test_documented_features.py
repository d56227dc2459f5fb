"""Features README.md documents, each checked by its effect (issue 26).

Cheap by design (CPU, the tiny models, eager training, a few steps): the trainer runs
in-process (:func:`boost_compiler.train.train`), its flags parsed by the CLI's own parser;
the backend options run on torch's fake process group or under ``lowering="eager"``;
two checks need two ranks (tests/documented_checks.py through tests.tp_harness.run_world):
``--init-from``'s "every rank takes rank 0's factors" and ``compile_in_turns=False``
(an Inductor compile per rank: the full tier, BOOST_FULL_TESTS=1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import boost_compiler
from boost_compiler.errors import OptionTypeError, TrainConfigError
from boost_compiler.train import TrainConfig, loop, setup, train
from boost_compiler.train.config import add_arguments, from_args
from boost_compiler.train.data import open_data
from tests.extras import need
from tests.tp_harness import RTOL, result_of, run_world

ROOT = Path(__file__).resolve().parent.parent
FULL = os.environ.get("BOOST_FULL_TESTS") == "1"
FAST = {"compile": False, "progress": False, "log_every": 100}
# A tiny Llama: every factor's rank divides by tp=2; the vocabulary holds the byte tokens.
LLAMA: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
)  # fmt: skip


def _config(*flags: str) -> TrainConfig:
    """``boost train FLAGS`` as the CLI parses them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(flags)))


def _records(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in recs if r.get("event") == event]


def _bytes_stream(docs: list[str]) -> list[int]:
    """The documented packing of byte tokens: each document's UTF-8 bytes, then NUL."""
    out: list[int] = []
    for d in docs:
        out += [*d.encode(), 0]
    return out


def _docs(row: list[int], eos: int) -> list[list[int]]:
    """The complete documents of a packed row (the part after the last EOS dropped)."""
    out, cur = [], []
    for t in row:
        if t == eos:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out


# --- 1. --eval-data: a separate held-out file ------------------------------------------------

TRAIN_TEXTS = [f"the cat sat on the mat number {i} and then it ran away" for i in range(40)]
# Another alphabet and length: a held-out loss far from the training file's.
HELD_TEXTS = ["ZQXJ 0123456789 KWVY", "9876543210 QQQ ZZZ XXX JJJ", "VWXYZ 55555 44444 KJQ"]


def test_eval_data_is_the_held_out_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need("datasets")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                  for t in TRAIN_TEXTS))  # fmt: skip
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in HELD_TEXTS))  # fmt: skip
    seq, batch = 16, 2
    held = _bytes_stream(HELD_TEXTS)
    # Whole batches of the held-out file (4 sequences): fewer than --eval-batches 4 x 2.
    n = min(4, len(held) // seq // batch)
    assert n == 2, n
    metrics = tmp_path / "metrics.jsonl"
    cfg = _config("--data", str(tmp_path / "train.jsonl"), "--eval-data",
                  str(tmp_path / "held.jsonl"), "--eval-every", "2", "--eval-batches", "4",
                  "--steps", "4", "--lr", "1e-2", "--batch", str(batch), "--seq", str(seq), "--warmup", "1",
                  "--metrics", str(metrics), "--no-compile", "--no-progress")  # fmt: skip
    result = train(cfg)
    evals = _records(metrics, "eval")
    assert [r["step"] for r in evals] == [1, 3]
    for rec in evals:  # the held-out file's size, not --eval-batches x --batch (8)
        assert (rec["eval_sequences"], rec["eval_tokens"]) == (n * batch, n * batch * seq), rec
    assert _records(metrics, "start")[0]["eval_sequences"] == n * batch
    # The last eval is the final model's mean loss on the held-out file's batches ...
    ids = torch.tensor(held[: n * batch * seq]).view(n, batch, seq)
    on_train = torch.tensor(_bytes_stream(TRAIN_TEXTS)[: n * batch * seq]).view(n, batch, seq)
    model = result.model
    with torch.no_grad():
        want = sum(float(model(b, labels=b)) for b in ids) / n
        train_loss = sum(float(model(b, labels=b)) for b in on_train) / n
    print("eval", evals[-1]["eval_loss"], "held-out", want, "training file", train_loss)
    assert evals[-1]["eval_loss"] == pytest.approx(want, rel=1e-5)
    # ... and not the loss of the training file (which the model has begun to learn).
    assert evals[-1]["eval_loss"] > train_loss + 0.2


# --- 2. --txt-unit file|paragraph|line --------------------------------------------------------

FILE_A = "ab cd\nef gh\n\nij kl\nmn\n\nop\n"
FILE_B = "qr st\nuv\n"


@pytest.mark.parametrize("unit", ["file", "paragraph", "line"])
def test_txt_unit_splits_documents(tmp_path: Path, unit: str) -> None:
    need("datasets")
    (tmp_path / "a.txt").write_text(FILE_A)
    (tmp_path / "b.txt").write_text(FILE_B)
    flags = ["--data", str(tmp_path), "--batch", "1", "--seq", "64"]
    if unit != "file":
        flags += ["--txt-unit", unit]
    else:
        assert _config(*flags).txt_unit == "file"  # the default
    row = open_data(_config(*flags), 0, 1).rows(0).flatten().tolist()
    want = {
        "file": [FILE_A, FILE_B],
        "paragraph": ["ab cd\nef gh", "ij kl\nmn", "op", "qr st\nuv"],
        "line": ["ab cd", "ef gh", "ij kl", "mn", "op", "qr st", "uv"],
    }[unit]
    # The first epoch's documents, each ended by NUL, then the first one again.
    docs = [bytes(d).decode() for d in _docs(row, 0)]
    print(unit, docs)
    if unit == "paragraph":  # a paragraph's own trailing newline is datasets' to keep
        docs = [d.strip("\n") for d in docs]
    assert docs[: len(want) + 1] == [*want, want[0]], docs


# --- 3. --eos-token ---------------------------------------------------------------------------


def test_eos_token_separates_documents(tmp_path: Path) -> None:
    need("datasets")
    tokenizers = need("tokenizers")
    texts = [f"the cat sat on mat {i % 3}" for i in range(12)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=48, show_progress=False,
                                             special_tokens=["[UNK]", "</s>", "<sep>"])  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    base = ["--data", str(tmp_path / "d.jsonl"), "--tokenizer", str(tmp_path / "tok.json"),
            "--batch", "2", "--seq", "24"]  # fmt: skip
    sep, slash_s = tok.token_to_id("<sep>"), tok.token_to_id("</s>")
    for flags, eos, other in (
        (base, slash_s, sep),
        ([*base, "--eos-token", "<sep>"], sep, slash_s),
    ):
        src = open_data(_config(*flags), 0, 1)
        assert (src.describe()["eos_token"], src.describe()["eos_id"]) == (
            tok.id_to_token(eos), eos)  # fmt: skip
        row = src.rows(0).flatten().tolist()
        want: list[int] = []
        for t in texts:
            want += [*tok.encode(t, add_special_tokens=False).ids, eos]
        assert row == want[: len(row)]
        assert other not in row and row.count(eos) >= 3, row


# --- 4. --bf16 --------------------------------------------------------------------------------


def test_bf16_trains_a_bf16_model(monkeypatch: pytest.MonkeyPatch) -> None:
    dtypes: list[set[torch.dtype]] = []
    real = loop.train_step

    def step(run: Any, i: int) -> Any:
        dtypes.append({p.dtype for p in run.model.parameters()})
        return real(run, i)

    monkeypatch.setattr(loop, "train_step", step)
    cfg = _config("--bf16", "--steps", "6", "--batch", "4", "--seq", "32", "--lr", "1e-2",
                  "--warmup", "1", "--no-compile", "--no-progress")  # fmt: skip
    assert cfg.bf16
    result = train(cfg)
    assert dtypes == [{torch.bfloat16}] * 6, dtypes
    losses = [result.losses[s] for s in range(6)]
    print("bf16 losses", losses)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.1


# --- 5. --low-rank-method svd, --rank, --rank-multiple ----------------------------------------


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tf = need("transformers")
    folder = tmp_path_factory.mktemp("llama-config")
    tf.LlamaConfig(**LLAMA).save_pretrained(folder)
    return folder


def test_svd_rank_and_rank_multiple(llama_config: Path, tmp_path: Path) -> None:
    tf = need("transformers")
    from boost_compiler.convert import low_rank_layout
    from boost_compiler.hf_io import LOW_RANK_KEY
    from boost_compiler.train import checkpoint as ckpt
    from boost_compiler.train import hf_model

    flags = ["--hf-config", str(llama_config), "--low-rank-method", "svd", "--seq", "32"]
    run = tmp_path / "run"
    result = train(_config(*flags, "--rank", "16", "--rank-multiple", "8", "--steps", "1",
                           "--batch", "2", "--checkpoint-dir", str(run), "--no-compile",
                           "--no-progress"))  # fmt: skip
    assert math.isfinite(result.losses[0])
    sd, state = ckpt.single_device_state_dict(run / "step_1")
    downs = {k: v.shape for k, v in sd.items() if k.endswith(".down.weight")}
    ups = {k: v.shape for k, v in sd.items() if k.endswith(".up.weight")}
    assert len(downs) == len(ups) == 7 * LLAMA["num_hidden_layers"], sorted(downs)
    assert {s[0] for s in downs.values()} == {16} and {s[1] for s in ups.values()} == {16}
    layout = state[hf_model.STATE_KEY][LOW_RANK_KEY]
    assert layout["method"] == "svd"
    assert {m["rank"] for m in layout["modules"].values()} == {16}
    assert {m["activation"] for m in layout["modules"].values()} == {None}  # no CoLA SiLU
    # svd: the factors are the truncated SVD of the dense model drawn under --seed.
    model = hf_model.build(_config(*flags, "--rank", "16"))
    torch.manual_seed(0)
    dense = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(llama_config))
    w = dense.model.layers[0].self_attn.q_proj.weight.detach()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    best = (u[:, :16] * s[:16]) @ vh[:16]
    q = model.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q.up.weight @ q.down.weight, best, rtol=1e-4, atol=1e-5)
    # --rank-ratio rounds down to a multiple of --rank-multiple: 0.3 x 64 = 19 -> 18 or 16.
    for multiple, rank in ((6, 18), (8, 16)):
        m = hf_model.build(_config(*flags, "--rank-ratio", "0.3", "--rank-multiple", str(multiple)))
        ranks = {s["rank"] for n, s in low_rank_layout(m).items() if "mlp" in n or "q_proj" in n}
        assert ranks == {rank}, (multiple, ranks)
    with pytest.raises(TrainConfigError, match=r"--rank \(12\) must be a multiple of "
                                               r"--rank-multiple \(8\)"):  # fmt: skip
        train(_config(*flags, "--rank", "12", "--rank-multiple", "8", "--steps", "1",
                      "--no-compile", "--no-progress"))  # fmt: skip


# --- 6. backend options btp="replicated_head", inline_regions, functionalize ------------------


def _tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    from boost_compiler.models.cola_llama import build, example_inputs

    model = build("tiny")
    (ids,) = example_inputs(model.cfg, batch=2, seq=16)
    return model, ids


@pytest.mark.parametrize("options", [{}, {"btp": "replicated_head"}])
def test_btp_replicated_head_keeps_the_head_whole(options: dict[str, Any]) -> None:
    from boost_compiler.tp.groups import fake_process_group

    model, ids = _tiny()
    with fake_process_group(2):
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids},
                                   options=options)  # fmt: skip
        params = {k: str(v) for k, v in model.boost_plan.params.items()}
        local = model.lm_head.weight.shape
    want = "R" if options else "S(0)"  # vocabulary-parallel by default
    assert params["lm_head.weight"] == want, params
    assert tuple(local) == ((256, 64) if options else (128, 64))
    assert params["layers.0.attn.q_proj.down.weight"] != "R"  # the factors are still split


@pytest.mark.parametrize("option", ["inline_regions", "functionalize"])
def test_front_passes_cannot_be_switched_off_for_a_parallel_model(option: str) -> None:
    from boost_compiler.tp.groups import fake_process_group

    model, ids = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with fake_process_group(2), pytest.raises(OptionTypeError, match=f"switched off: '{option}'"):
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids},
                                   options={option: False})  # fmt: skip
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _Checkpointed(torch.nn.Module):
    """A layer run under torch.utils.checkpoint (the region dynamo makes a higher-order op)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, *args, use_reentrant=False)


def _compiled_stages(model: torch.nn.Module, args: tuple, options: dict[str, Any], out: Path,
                     **kwargs: Any) -> tuple[Any, dict[str, str], int]:  # fmt: skip
    """Compile (lowering eager), run once; (output, stage -> graph code, bottlenecks found)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    opts = {**options, "lowering": "eager", "dump_dir": str(out)}
    res = torch.compile(model, backend="boost", options=opts)(*args, **kwargs)
    (graph,) = [d for d in out.iterdir() if d.is_dir()]
    stages = {}
    for p in sorted(graph.glob("*.py")):  # the code without dynamo's source-line comments
        lines = [ln for ln in p.read_text().splitlines() if not ln.strip().startswith("#")]
        stages[p.stem.split("_", 1)[1]] = "\n".join(lines)
    return res, stages, counters["boost"]["bottlenecks"]


@pytest.mark.parametrize("inline", [True, False])
def test_inline_regions_option(tmp_path: Path, inline: bool) -> None:
    """Default: the checkpoint regions' ops are in the graph the passes see, so their
    bottlenecks are found; False: the regions stay higher-order ops, their factors unseen."""
    model, ids = _tiny()
    with torch.no_grad():
        ref = float(model(ids, labels=ids))
    model.layers = torch.nn.ModuleList(_Checkpointed(layer) for layer in model.layers)
    options = {} if inline else {"inline_regions": False}
    loss, stages, found = _compiled_stages(model, (ids,), options, tmp_path, labels=ids)
    last = list(stages.values())[-1]
    assert ("inline_regions" in stages) == inline, list(stages)
    assert "tag_activation_checkpoint" in stages["input"]
    assert ("tag_activation_checkpoint" in last) == (not inline)
    assert found == (14 if inline else 0), found  # 7 factor pairs per layer, 2 layers
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-6)  # same values either way


class _InPlace(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        v = h.view(-1)
        h.mul_(2)  # read back through the alias v
        return v.sum() + h.sum()


@pytest.mark.parametrize("functional", [True, False])
def test_functionalize_option(tmp_path: Path, functional: bool) -> None:
    """Default: no in-place op is left in the graph; False: the graph keeps ``mul_``."""
    torch.manual_seed(0)
    model, x = _InPlace(), torch.randn(3, 16)
    want = model(x)
    options = {} if functional else {"functionalize": False}
    got, stages, _ = _compiled_stages(model, (x,), options, tmp_path)
    assert ".mul_(" in stages["input"]
    assert (".mul_(" in list(stages.values())[-1]) == (not functional)
    assert ("functionalize" in stages) == functional
    torch.testing.assert_close(got, want)


# --- 8. TORCH_TRACE: the passes' graphs reach tlparse -----------------------------------------

TRACE_SCRIPT = """
import torch, sys
{patch}
from boost_compiler.models.cola_llama import build, example_inputs
m = build("tiny"); (ids,) = example_inputs(m.cfg, batch=1, seq=8)
torch.compile(m, backend="boost", options={{"lowering": "eager"}})(ids, labels=ids)
"""


def traced_artifacts(out: Path, patch: str = "") -> list[str]:
    """The names of the ``artifact`` records a TORCH_TRACE run of the backend wrote."""
    env = {**os.environ, "TORCH_TRACE": str(out), "PYTHONPATH": str(ROOT)}
    env.pop("BOOST_DUMP_DIR", None)
    code = TRACE_SCRIPT.format(patch=patch)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT, timeout=600)
    names = []
    for log in out.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if '"artifact"' in line:
                start = line.find("{")
                try:
                    rec = json.loads(line[start:])
                except ValueError:
                    continue
                names.append(rec["artifact"]["name"])
    return names


def test_torch_trace_gets_every_pass_graph(tmp_path: Path) -> None:
    names = traced_artifacts(tmp_path / "trace")
    boost = [n for n in names if n.startswith("boost_")]
    print(boost)
    from boost_compiler.passes import PIPELINE

    stages = ["input", *(p.name for p in PIPELINE if p.name != "checkpoint")]
    want = [f"boost_{i:02d}_{s}" for i, s in enumerate(stages)]
    assert [n for n in boost if not n.endswith("_layers_dot")] == want, boost


# --- 9. the 60m and 1b presets ----------------------------------------------------------------


def _shapes_match_preset(model: torch.nn.Module, name: str) -> None:
    from boost_compiler.models.cola_llama import CONFIGS

    c = CONFIGS[name]
    p = dict(model.named_parameters())
    assert model.cfg.d_model == c.d_model and len(model.layers) == c.n_layers  # type: ignore[union-attr]
    assert p["embed.weight"].shape == (c.vocab_size, c.d_model)
    last = c.n_layers - 1
    assert p[f"layers.{last}.mlp.gate_proj.down.weight"].shape == (c.rank, c.d_model)
    assert p[f"layers.{last}.mlp.gate_proj.up.weight"].shape == (c.d_ff, c.rank)
    assert p[f"layers.{last}.attn.o_proj.down.weight"].shape == (c.rank, c.d_model)
    assert p["lm_head.weight"].shape == (c.vocab_size, c.d_model)


def test_60m_preset_trains_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[torch.nn.Module] = []
    real = setup.build_model

    def build(cfg: TrainConfig) -> torch.nn.Module:
        built.append(real(cfg))
        return built[-1]

    monkeypatch.setattr(setup, "build_model", build)
    result = train(_config("--model", "60m", "--steps", "1", "--batch", "1", "--seq", "16",
                           "--no-compile", "--no-progress"))  # fmt: skip
    (model,) = built
    _shapes_match_preset(model, "60m")
    loss = result.losses[0]
    assert math.isfinite(loss) and abs(loss - math.log(32000)) < 1.0, loss  # a fresh 32k head


def test_1b_preset_shapes_on_meta() -> None:
    from boost_compiler.models.cola_llama import build

    model = build("1b", device="meta")
    _shapes_match_preset(model, "1b")
    assert all(p.is_meta for p in model.parameters())


# --- 7 and 10. two ranks: compile_in_turns=False, --init-from's rank-0 factors ----------------


@pytest.fixture(scope="module")
def dense_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tf = need("transformers")
    need("safetensors")
    folder = tmp_path_factory.mktemp("llama-dense")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).save_pretrained(folder)
    return folder


SLOW = {"compile_in_turns_off"}


@pytest.fixture(scope="module")
def two(dense_llama: Path) -> dict[str, Any]:
    checks = [
        ("init_from", "tests.documented_checks:init_from_factors", (str(dense_llama), False)),
        ("init_from/flipped", "tests.documented_checks:init_from_factors",
         (str(dense_llama), True)),
        ("compile_in_turns_off", "tests.documented_checks:compile_in_turns_off", ()),
    ]  # fmt: skip
    return run_world(2, checks, slow=SLOW)


@pytest.mark.parametrize("key", ["init_from", "init_from/flipped"])
def test_init_from_every_rank_takes_rank_0s_factors(two: dict[str, Any], dense_llama: Path,
                                                    key: str) -> None:  # fmt: skip
    """Bit-identical parameters on both ranks, even when rank 1's SVD took the other signs;
    and the factors are the loaded weights' (same products as a one-process init)."""
    from boost_compiler.train import hf_model

    res = result_of(two, key)
    ranks = res["ranks"]
    assert ranks[0]["n_factors"] == 7 * LLAMA["num_hidden_layers"]
    assert ranks[0]["digests"] == ranks[1]["digests"], [
        n for n in ranks[0]["digests"] if ranks[0]["digests"][n] != ranks[1]["digests"][n]
    ]
    one = hf_model.build(TrainConfig(init_from=str(dense_llama), seq=32))
    pair = dict(one.named_modules())[ranks[0]["first"]]
    product = (pair.up.weight @ pair.down.weight).double()
    assert float(product.norm()) == pytest.approx(ranks[0]["product_norm"], rel=1e-5)
    assert float(product.sum()) == pytest.approx(ranks[0]["product_sum"], rel=1e-4, abs=1e-6)


def test_compile_in_turns_false_is_exact(two: dict[str, Any]) -> None:
    res = result_of(two, "compile_in_turns_off")
    assert res["default_in_turns"] is True  # the suite's BOOST_COMPILE_IN_TURNS=1 ...
    assert res["turns"] == 0, res["turns"]  # ... yet no rank waited for its turn
    assert res["graphs"] >= 1
    print({k: res[k] for k in ("loss_err", "grad_err", "param_err")})
    for what in ("loss_err", "grad_err", "param_err"):
        assert res[what] <= RTOL, (what, res[what], res.get(f"{what[:-4]}_worst"))
    assert max(res["out_err"]) <= RTOL, res["out_err"]
