"""Real data for ``boost train`` (issue 18): files streamed through ``datasets``, tokenized with
a tokenizer built here, packed with EOS between documents, sharded over dp, resumed exactly.

CPU, gloo, eager (``--no-compile``), the tiny CoLA-LLaMA sized from the tokenizer. The
trainer runs in-process (:func:`train` / the CLI) or as ``python -m tests.train_data_probe``
processes (torchrun's environment variables; one is SIGKILLed), which save every batch
they train on. The module fixture starts the independent processes at once.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from boost_compiler.cli import main as cli_main
from boost_compiler.errors import (
    CheckpointCorruptError,
    DataError,
    TrainConfigError,
    VocabSizeError,
)
from boost_compiler.train import TrainConfig, latest, read_metrics, setup, train
from boost_compiler.train import checkpoint as ckpt
from boost_compiler.train.data import open_data
from boost_compiler.train.setup import build_model
from tests.extras import need

need("datasets")
tokenizers = need("tokenizers")

ROOT = Path(__file__).resolve().parent.parent
# EVERY does not divide STEPS: the last step's eval is the one --eval-every does not give
STEPS, BATCH, SEQ, EVERY = 8, 4, 32, 3
TIMEOUT = 600  # seconds per process: the CI cores are shared
WORDS = ("the a cat dog bird sat ran flew on under over mat tree roof fast slow big small "
         "red blue and then").split()  # fmt: skip


def _texts(n: int = 240, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """data.jsonl (field "text", plus another) and a BPE tokenizer.json trained on it here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("data")
    texts = _texts()
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=["[UNK]", "</s>"],
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tmp / "tokenizer.json"))
    return {"tmp": tmp, "texts": texts, "data": data, "tok": tmp / "tokenizer.json"}


def _stream(corpus: dict[str, Any], texts: list[str] | None = None, fraction: float = 0.0,
            split: str = "train") -> torch.Tensor:  # fmt: skip
    """The packed token stream as documented, computed here from the tokenizer file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus["tok"]))
    eos = tok.token_to_id("</s>")
    out: list[int] = []
    for d, text in enumerate(corpus["texts"] if texts is None else texts):
        held = fraction > 0 and math.floor((d + 1) * fraction) > math.floor(d * fraction)
        if held == (split == "eval"):
            out += [*tok.encode(text, add_special_tokens=False).ids, eos]
    return torch.tensor(out)


def _flags(corpus: dict[str, Any], **kw: Any) -> list[str]:
    base = {"data": corpus["data"], "tokenizer": corpus["tok"], "steps": STEPS, "batch": BATCH,
            "seq": SEQ, "warmup": 2, "lr": 1e-2, "eval_fraction": 0.1, "eval_every": EVERY,
            "eval_batches": 2}  # fmt: skip
    out = ["--no-compile", "--no-progress", "--log-every", "100"]
    for k, v in {**base, **kw}.items():
        if v is not None:
            flag = "--" + k.replace("_", "-")
            out += [flag] if v is True else [flag, str(v)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(logdir: Path, argv: list[str], world: int = 1) -> list[subprocess.Popen[bytes]]:
    """``world`` ranks of tests.train_data_probe, batches saved under ``logdir``."""
    logdir.mkdir(parents=True, exist_ok=True)
    port, procs = _free_port(), []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "BATCH_LOG": str(logdir)}  # fmt: skip
        with open(logdir / f"rank{rank}.log", "ab") as f:
            cmd = [sys.executable, "-m", "tests.train_data_probe", *argv]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f))
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], logdir: Path) -> None:
    for p in procs:
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
    bad = [r for r, p in enumerate(procs) if p.wait() != 0]
    if bad:
        tails = "\n".join(f"--- rank {r}:\n{(logdir / f'rank{r}.log').read_text()[-3000:]}"
                          for r in bad)  # fmt: skip
        raise AssertionError(f"ranks {bad} failed:\n{tails}")


def _batches(logdir: Path, rank: int = 0) -> dict[int, torch.Tensor]:
    out = {}
    for f in logdir.glob(f"rank{rank}_step*.pt"):
        out[int(f.stem.split("_step")[1])] = torch.load(f, weights_only=True)
    return dict(sorted(out.items()))


def _records(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in recs if r.get("event") == event]


def _evals(path: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in _records(path, "eval")}  # a resumed step: the later record


def _kill_after_checkpoint(proc: subprocess.Popen[bytes], ckdir: Path, metrics: Path) -> int:
    """SIGKILL once a checkpoint exists and the step after it was logged; the steps logged."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done = latest(ckdir)
        if done is not None and metrics.exists():
            step = int(done.name.removeprefix("step_"))
            try:
                if max(read_metrics(metrics), default=-1) >= step:
                    break
            except json.JSONDecodeError:  # a line being written
                pass
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    else:
        proc.kill()
        raise AssertionError("no checkpoint appeared")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    return max(read_metrics(metrics))


@pytest.fixture(scope="module")
def runs(corpus: dict[str, Any]) -> dict[str, Any]:
    """full: 8 steps; kill: the same, SIGKILLed after a checkpoint, then resumed; dp2: 2 ranks."""
    tmp, out = corpus["tmp"], {}
    t0 = time.monotonic()

    def paths(name: str) -> dict[str, Any]:
        return {"checkpoint_dir": tmp / name / "ckpt", "metrics": tmp / name / "metrics.jsonl"}

    full = _start(tmp / "full", _flags(corpus, save_every=2, **paths("full")))
    kill = _start(tmp / "kill", _flags(corpus, save_every=2, throttle=0.5, **paths("kill")))
    dp2 = _start(tmp / "dp2", _flags(corpus, dp=2, stop_at=4, **paths("dp2")), world=2)
    out["killed_after"] = _kill_after_checkpoint(kill[0], tmp / "kill" / "ckpt",
                                                 tmp / "kill" / "metrics.jsonl")  # fmt: skip
    out["resumed_from"] = int(latest(tmp / "kill" / "ckpt").name.removeprefix("step_"))  # type: ignore[union-attr]
    resumed = _start(tmp / "resumed", _flags(corpus, save_every=2, resume=True, **paths("kill")))
    for name, procs in (("full", full), ("dp2", dp2), ("resumed", resumed)):
        _wait(procs, tmp / name)
        out[f"t_{name}"] = time.monotonic() - t0
    print("run timings (s, since start):", {k: round(v, 1) for k, v in out.items() if "t_" in k})
    return out


def _losses(path: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(path).items()}


def test_jsonl_batches_are_the_packed_stream(corpus: dict[str, Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """(1) The CLI on data.jsonl + tokenizer.json: every batch is the packed stream, losses fall."""
    seen: dict[int, torch.Tensor] = {}
    original = setup.Run.batch

    def record(self: Any, step: int) -> torch.Tensor:
        seen[step] = original(self, step)
        return seen[step]

    monkeypatch.setattr(setup.Run, "batch", record)
    metrics = tmp_path / "metrics.jsonl"
    argv = _flags(corpus, eval_fraction=None, eval_every=None, eval_batches=None, metrics=metrics)
    assert cli_main(["train", *argv]) == 0
    stream = _stream(corpus)
    assert sorted(seen) == list(range(STEPS))
    for step, ids in seen.items():
        want = stream[step * BATCH * SEQ : (step + 1) * BATCH * SEQ].view(BATCH, SEQ)
        assert torch.equal(ids, want), step
    tok = tokenizers.Tokenizer.from_file(str(corpus["tok"]))
    start = _records(metrics, "start")[0]
    assert (start["eos_token"], start["eos_id"]) == ("</s>", tok.token_to_id("</s>"))
    assert start["vocab_size"] == tok.get_vocab_size()
    losses = _losses(metrics)
    print("losses:", [round(v, 4) for v in losses.values()])
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS - 1] < losses[0] - 0.1


def test_kill_and_resume_continue_the_stream(runs: dict[str, Any], corpus: dict[str, Any]
                                             ) -> None:  # fmt: skip
    """(2) SIGKILL after a checkpoint; --resume: the same next batches, losses within 1e-6."""
    tmp, k = corpus["tmp"], runs["resumed_from"]
    assert 0 < k < STEPS and runs["killed_after"] >= k  # steps after the checkpoint were lost
    starts = [r["step"] for r in _records(tmp / "kill" / "metrics.jsonl", "start")]
    assert starts == [0, k]
    want, got = _losses(tmp / "full" / "metrics.jsonl"), _losses(tmp / "kill" / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(STEPS))
    errs = {s: abs(got[s] - want[s]) / abs(want[s]) for s in range(STEPS)}
    print(f"killed after step {runs['killed_after']}, resumed from step_{k}; rel errors {errs}")
    assert max(errs.values()) < 1e-6
    full, resumed = _batches(tmp / "full"), _batches(tmp / "resumed")
    assert sorted(resumed) == list(range(k, STEPS))
    for s, ids in resumed.items():
        assert torch.equal(ids, full[s]), s
    ev_want, ev_got = _evals(tmp / "full" / "metrics.jsonl"), _evals(tmp / "kill" / "metrics.jsonl")
    assert sorted(ev_got) == sorted(ev_want)
    for s in ev_want:
        assert ev_got[s]["eval_loss"] == pytest.approx(ev_want[s]["eval_loss"], rel=1e-6)
    # The saved position: after step k, k * BATCH sequences, the same in both runs.
    saved = ckpt.read_state(tmp / "kill" / "ckpt" / f"step_{k}")["data"]
    assert (
        saved["position"]
        == ckpt.read_state(tmp / "full" / "ckpt" / f"step_{k}")["data"]["position"]
    )
    assert saved["position"]["sequences"] == k * BATCH


def test_dp_ranks_see_disjoint_rows_whose_union_is_the_stream(runs: dict[str, Any],
                                                              corpus: dict[str, Any]) -> None:  # fmt: skip
    """(3) --dp 2 (gloo): rank r trains on rows [2r, 2r + 2) of the single-rank batch."""
    tmp = corpus["tmp"]
    full = _batches(tmp / "full")
    ranks = [_batches(tmp / "dp2", r) for r in (0, 1)]
    assert sorted(ranks[0]) == sorted(ranks[1]) == [0, 1, 2, 3]
    for s in range(4):
        a, b = ranks[0][s], ranks[1][s]
        assert a.shape == b.shape == (BATCH // 2, SEQ)
        assert not {tuple(r) for r in a.tolist()} & {tuple(r) for r in b.tolist()}, s
        assert torch.equal(torch.cat([a, b]), full[s]), s
    want, got = _losses(tmp / "full" / "metrics.jsonl"), _losses(tmp / "dp2" / "metrics.jsonl")
    assert sorted(got) == [0, 1, 2, 3]
    assert max(abs(got[s] - want[s]) / want[s] for s in got) < 1e-4
    ev_want, ev_got = _evals(tmp / "full" / "metrics.jsonl"), _evals(tmp / "dp2" / "metrics.jsonl")
    assert sorted(ev_got) == [EVERY - 1, 3]  # every EVERY steps, and the last (--stop-at 4)
    assert EVERY - 1 in ev_want
    for s in (EVERY - 1,):  # the full run evaluated that step too
        assert ev_got[s]["eval_loss"] == pytest.approx(ev_want[s]["eval_loss"], rel=1e-4)
    # Every rank holds the same global position: the step-4 checkpoints agree across dp.
    state = ckpt.read_state(tmp / "dp2" / "ckpt" / "step_4")["data"]
    assert (
        state["position"] == ckpt.read_state(tmp / "full" / "ckpt" / "step_4")["data"]["position"]
    )
    assert [r["next_rows"] for r in state["dp_ranks"]] == [[16, 18], [18, 20]]


def test_eval_loss_and_perplexity_every_k_steps(runs: dict[str, Any], corpus: dict[str, Any]
                                                ) -> None:  # fmt: skip
    """(4) An eval record every --eval-every steps and at the last; held-out documents are
    never trained on."""
    tmp = corpus["tmp"]
    evals = _evals(tmp / "full" / "metrics.jsonl")
    assert sorted(evals) == [s for s in range(STEPS) if (s + 1) % EVERY == 0] + [STEPS - 1]
    for rec in evals.values():
        assert math.isfinite(rec["eval_loss"])
        assert rec["eval_ppl"] == pytest.approx(math.exp(rec["eval_loss"]), rel=1e-12)
        assert rec["eval_sequences"] == 2 * BATCH and rec["eval_tokens"] == 2 * BATCH * SEQ
    assert evals[STEPS - 1]["eval_loss"] < evals[EVERY - 1]["eval_loss"]
    # The training batches are the stream of the documents not held out (1 in 10).
    train_stream = _stream(corpus, fraction=0.1)
    for s, ids in _batches(tmp / "full").items():
        assert torch.equal(ids.flatten(), train_stream[s * BATCH * SEQ : (s + 1) * BATCH * SEQ]), s


def test_eval_loss_is_the_held_out_loss_of_the_saved_parameters(
    runs: dict[str, Any], corpus: dict[str, Any]
) -> None:
    """(4) The validation loss, recomputed here from the checkpoint's weights.

    Independent of the trainer's evaluation code: the held-out tokens come from
    :func:`_stream` (the tokenizer file and the documented split), the weights from the
    checkpoint saved right after the step that was evaluated, the loss from an explicit
    next-token cross-entropy over every held-out token. It fails for an evaluation on
    the training split, for a sum of batch means, and without an eval at the last step.
    """
    from torch.nn import functional as F

    evals = _evals(corpus["tmp"] / "full" / "metrics.jsonl")
    assert STEPS - 1 in evals, sorted(evals)  # the last step is evaluated
    rows = 2 * BATCH  # --eval-batches 2
    held = _stream(corpus, fraction=0.1, split="eval")[: rows * SEQ].reshape(rows, SEQ)
    model = build_model(TrainConfig(tokenizer=str(corpus["tok"])))
    for step in (5, STEPS - 1):  # checkpoints every 2 steps: step_6 and step_8
        sd, _ = ckpt.single_device_state_dict(corpus["tmp"] / "full" / "ckpt" / f"step_{step + 1}")
        model.load_state_dict(sd, strict=True)
        model.eval()
        with torch.no_grad():
            logits = model(held).double()
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1), held[:, 1:].flatten()).item()
        assert evals[step]["eval_loss"] == pytest.approx(want, rel=1e-5), (step, want)


def test_data_position_is_covered_by_the_manifest(runs: dict[str, Any], corpus: dict[str, Any],
                                                  tmp_path: Path) -> None:  # fmt: skip
    src = corpus["tmp"] / "full" / "ckpt" / "step_4"
    dst = tmp_path / "step_4"
    shutil.copytree(src, dst)
    state = json.loads((dst / "train_state.json").read_text())
    state["data"]["position"]["record"] += 1
    (dst / "train_state.json").write_text(json.dumps(state, indent=1))
    with pytest.raises(CheckpointCorruptError, match="train_state.json"):
        ckpt.checked(dst)


def _source(corpus: dict[str, Any], **kw: Any) -> Any:
    cfg = TrainConfig(data=[str(corpus["data"])], tokenizer=str(corpus["tok"]), batch=2, seq=48,
                      **kw)  # fmt: skip
    return open_data(cfg, 0, 1)


def test_restored_position_continues_mid_document_and_across_epochs(corpus: dict[str, Any]
                                                                    ) -> None:  # fmt: skip
    """A reader restored from any saved position yields what the uninterrupted one yields next."""
    small = corpus["tmp"] / "small.jsonl"
    small.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus["texts"][:12]))
    positions = []
    for k in (1, 3, 8):  # 12 short documents, ~3 batches: the files wrap within these
        one = _source({**corpus, "data": small})
        for s in range(k):
            one.rows(s)
        state = json.loads(json.dumps(one.state()))  # through JSON, as in train_state.json
        positions.append(state["position"])
        want = [one.rows(k + i) for i in range(3)]
        two = _source({**corpus, "data": small})
        two.restore(state)
        assert all(torch.equal(two.rows(k + i), want[i]) for i in range(3)), k
    assert [p["sequences"] for p in positions] == [2, 6, 16]
    assert any(p["offset"] > 0 for p in positions) and positions[-1]["epoch"] > 0, positions


def test_folder_of_txt_jsonl_parquet_and_bytes(corpus: dict[str, Any], tmp_path: Path) -> None:
    """A folder: its .txt (one document per file), .jsonl, .parquet files sorted; README skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus["texts"]
    (tmp_path / "a.txt").write_text(texts[0] + "\n" + texts[1])
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": texts[2]}) + "\n")
    pq.write_table(pa.table({"body": [texts[3], texts[4]], "n": [1, 2]}), tmp_path / "c.parquet")
    (tmp_path / "README.md").write_text("not data")
    src = _source({**corpus, "data": tmp_path}, text_field="body")
    docs = [texts[0] + "\n" + texts[1], *texts[2:5]]
    want = _stream(corpus, docs)
    n = want.numel() // (2 * 48)
    got = torch.cat([src.rows(s).flatten() for s in range(n)])
    assert torch.equal(got, want[: got.numel()])
    # Without --tokenizer: UTF-8 bytes, each document ended by NUL (id 0); then the next epoch.
    (tmp_path / "hi.txt").write_text("hi")
    raw = open_data(TrainConfig(data=[str(tmp_path / "hi.txt")], batch=1, seq=7), 0, 1)
    assert raw.rows(0).flatten().tolist() == [104, 105, 0, 104, 105, 0, 104]


def test_empty_files_in_a_folder_are_skipped_or_refused(tmp_path: Path, caplog: Any) -> None:
    """A 0-byte file in a folder is named and skipped; a folder of only empty files is an
    error at the flag check, not an epoch that reads nothing."""
    from boost_compiler.train.stream import resolve_files

    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.txt").write_text("text")
    with caplog.at_level("WARNING", logger="boost_compiler"):
        assert resolve_files([str(tmp_path)]) == [tmp_path / "b.txt"]
    assert "skipping 1 empty file(s)" in caplog.text and "a.jsonl" in caplog.text
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(DataError, match="every data file in this folder is empty"):
        resolve_files([str(tmp_path)])


@pytest.mark.parametrize("case", ["missing", "extension", "field", "column", "empty"])
def test_data_errors_name_the_file(corpus: dict[str, Any], tmp_path: Path, case: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = {"missing": tmp_path / "nope.jsonl", "extension": tmp_path / "data.csv",
            "field": corpus["data"], "column": tmp_path / "t.parquet",
            "empty": tmp_path / "empty.jsonl"}[case]  # fmt: skip
    if case == "empty":  # every document empty: an error, not a reader that spins forever
        path.write_text('{"content": ""}\n' * 3)
    if case == "extension":
        path.write_text("text\nhello\n")
    if case == "column":
        pq.write_table(pa.table({"body": ["x"]}), path)
    match = {"missing": "no such file", "extension": "unknown extension '.csv'",
             "field": "no text field 'content'", "column": "no column 'content'",
             "empty": "no train documents"}[case]  # fmt: skip
    with pytest.raises(DataError, match=match) as err:
        _source({**corpus, "data": path}, text_field="content").example()
    assert str(path) in str(err.value)


def test_vocab_size_from_the_tokenizer_or_a_named_error(corpus: dict[str, Any]) -> None:
    vocab = tokenizers.Tokenizer.from_file(str(corpus["tok"])).get_vocab_size()
    cfg = TrainConfig(data=[str(corpus["data"])], tokenizer=str(corpus["tok"]))
    assert build_model(cfg).cfg.vocab_size == vocab  # type: ignore[union-attr]
    cfg.model_overrides = {"vocab_size": vocab - 1}
    with pytest.raises(VocabSizeError, match=f"vocab_size {vocab - 1} .* tokenizer's {vocab}"):
        build_model(cfg)
    with pytest.raises(TrainConfigError, match="--eval-every needs a held-out split"):
        train(TrainConfig(data=[str(corpus["data"])], eval_every=2, compile=False))


def test_a_transformers_tokenizer_folder(corpus: dict[str, Any], tmp_path: Path) -> None:
    """--tokenizer DIR: AutoTokenizer (local files only), its eos_token, the same ids."""
    transformers = need("transformers")
    from boost_compiler.train.tokenizer import load_tokenizer

    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(corpus["tok"]), eos_token="</s>")
    fast.save_pretrained(tmp_path / "tok")
    got, want = load_tokenizer(str(tmp_path / "tok")), load_tokenizer(str(corpus["tok"]))
    assert (got.vocab_size, got.eos_id, got.eos_token) == (want.vocab_size, want.eos_id, "</s>")
    assert got.encode(corpus["texts"][:3]) == want.encode(corpus["texts"][:3])
