"""Pipeline parallelism with BTP inside each stage (issue 17): exact, and shards on the wire.

CPU, gloo, eager, the tiny CoLA-LLaMA with 2 layers per stage: with ``m`` micro-batches
the pipelined step (loss; parameters after 2 SGD steps, gathered to global shapes)
equals one device's step on the whole batch within fp32 1e-5 relative, and what crosses
a stage boundary is each tp rank's ``[b/m, s, d/tp]``, sent to the same tp rank of the
next stage. (2, 1, 2) and (2, 1, 1) always run; the dp > 1 layouts with
``BOOST_FULL_TESTS=1`` (more processes than the 2 CI cores take in a quick run). The
same checks run on a tiny transformers ``LlamaForCausalLM`` made low-rank by
``to_low_rank(method="cola")`` (``train/pipeline_hf.py``), and ``train`` with
``--pp 2 --hf-config`` against one process.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from boost_compiler.costmodel import pipeline_boundary_bytes
from boost_compiler.errors import PipelineError
from boost_compiler.train.pipeline import split_layers
from tests.extras import REQUIRED, need
from tests.tp_harness import RTOL, result_of, run_world

FN = "tests.pipeline_checks:pipelined_step"
FULL = os.environ.get("BOOST_FULL_TESTS") == "1"
FULL_REASON = "dp > 1 layouts start 4-8 processes on 2 cores; BOOST_FULL_TESTS=1 runs them"
D_MODEL = 64  # the tiny preset's hidden size


# The transformers checks need the [hf] extra; without it the CoLA ones still run (but
# where the set-up installed it, tests.extras.REQUIRED, they run and fail on a broken one).
HAS_HF = REQUIRED or importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def four() -> dict:
    checks: list[tuple] = [
        ("pp2dp1tp2", FN, (2, 1, 2, 2)),
        ("pp2dp1tp2/compiled", FN, (2, 1, 2, 2), {"compile": True}),
    ]
    if HAS_HF:
        # Compiled: a transformers family through compiled stages at tp=2, in the CI tier.
        checks.append(("hf/pp2dp1tp2", FN, (2, 1, 2, 2), {"model": "hf", "compile": True}))
    checks.append(("pp2dp1tp2/zero-bubble", FN, (2, 1, 2, 4), {"schedule": "zero-bubble"}))
    if FULL:
        checks.append(("pp2dp2tp1", FN, (2, 2, 1, 2), {"batch": 8}))
        if HAS_HF:
            checks.append(("hf/pp2dp2tp1", FN, (2, 2, 1, 2), {"batch": 8, "model": "hf"}))
        checks.append(("pp2dp1tp2/interleaved-compiled", FN, (2, 1, 2, 4),
                       {"schedule": "interleaved-1f1b", "compile": True}))  # fmt: skip
    return run_world(4, checks)


def _llama_config(folder: Path) -> str:
    """A tiny Llama ``config.json`` folder (no weights) for ``--hf-config``: 2 layers, one
    per stage; every factor's rank (ratio 0.25, multiple of 8) divides by tp=2, and the
    vocabulary holds the byte tokens of the embedded corpus."""
    import transformers as tf

    tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    return _llama_config(tmp_path_factory.mktemp("llama-config")) if HAS_HF else None


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the ``--pp 2 --hf-config`` run saves; its export is checked below."""
    return str(tmp_path_factory.mktemp("hf-pp2") / "ckpt")


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A held-out text file for ``--eval-data`` (validation through the schedule)."""
    path = tmp_path_factory.mktemp("held-out") / "held.txt"
    path.write_text("".join(f"held-out line {i}: the quick brown fox jumps over {i * 7}\n"
                            for i in range(40)))  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def two(llama_config: str | None, hf_ckpt: str, held_out: str) -> dict:
    trainer = "tests.pipeline_checks:trainer"
    checks: list[tuple] = [("pp2dp1tp1", FN, (2, 1, 1, 2)),
                           ("pp2dp1tp1/gpipe-adamw", FN, (2, 1, 1, 2),
                            {"schedule": "gpipe", "opt": "adamw"}),
                           ("pp2dp1tp1/interleaved-1f1b", FN, (2, 1, 1, 4),
                            {"schedule": "interleaved-1f1b"}),
                           ("pp2dp1tp1/zero-bubble", FN, (2, 1, 1, 4), {"schedule": "zero-bubble"}),
                           ("train/pp2", trainer, (2, None), {"compile": True}),
                           ("train/pp2-layers", trainer, (2, 2),
                            {"pp_layers": (2, 0), "eval_data": held_out}),
                           ("train/pp2-zero-bubble", trainer, (2, None),
                            {"schedule": "zero-bubble", "n_layers": 4})]  # fmt: skip
    if HAS_HF:
        checks += [("hf/pp2dp1tp1", FN, (2, 1, 1, 2), {"model": "hf"}),
                   ("zoo/qwen3-padded", FN, (2, 1, 1, 2), {"model": "zoo:qwen3", "padded": True}),
                   ("train/hf-pp2", trainer, (2, 2),
                    {"hf_config": llama_config, "checkpoint_dir": hf_ckpt})]  # fmt: skip
    return run_world(2, checks)


def _needs_hf(key: str) -> None:
    if key.startswith(("hf/", "train/hf")) and not HAS_HF:
        pytest.skip("the transformers checks need the [hf] extra")


# The first and last stage's own parameters, under the whole model's names.
ENDS = {
    "cola": ({"embed.weight"}, {"lm_head.weight", "norm.weight"}),
    "hf": ({"model.embed_tokens.weight"}, {"lm_head.weight", "model.norm.weight"}),
}


def _check_ends(rks: list[dict], model: str) -> None:
    """The stage modules each rank built hold, besides their decoder layers, exactly the
    whole model's embedding (the first stage) and its final norm and head (the last): no
    stage in between holds any. ``want_ends`` is read off the whole model, and for the
    models :data:`ENDS` names, must be those names."""
    embed, tail = (set(names) for names in rks[0]["want_ends"])
    assert embed and tail, rks[0]["want_ends"]
    if model in ENDS:
        assert (embed, tail) == ENDS[model], rks[0]["want_ends"]
    for r in rks:
        first, last, middle = (set(names) for names in r["ends"])
        if any(f for _, f, _ in r["stages"]):
            assert first == embed, (r["global_rank"], r["ends"])
        if any(la for _, _, la in r["stages"]):
            assert last == tail, (r["global_rank"], r["ends"])
        assert not middle, (r["global_rank"], r["ends"])


def _check_exact(
    res: dict,
    pp: int,
    dp: int,
    tp: int,
    m: int,
    batch: int = 4,
    model: str = "cola",
    steps: int = 2,
    rtol: float = RTOL,
    noise: float | None = None,
) -> None:
    """``noise``: gradients and parameters are bounded tensor by tensor (norm-relative)
    by ``max(RTOL, noise x`` the single-device twin's drift on that tensor``)`` instead of
    ``rtol`` on their largest element (``pipelined_step(..., noise=True)``)."""
    rks = res["ranks"]
    assert len(rks) == pp * dp * tp
    _check_ends(rks, model)
    held = {s for r in rks for s, _, _ in r["stages"]}
    v = len(held) // pp  # stages per rank, placed round-robin
    assert held == set(range(pp * v))
    assert all([s for s, _, _ in r["stages"]] == list(range(r["stage"], pp * v, pp)) for r in rks)
    for r in rks:
        assert r["loss"] <= RTOL, r
        assert r["grad_params"] == r["params"], r  # every parameter's gradient was compared
        if noise is None:
            assert r["grad"] <= rtol, (r["worst_grad"], r)
            assert r["param"] <= rtol, (r["worst_param"], r)
            continue
        for what in ("grad", "param"):
            errs, drift = r[f"{what}_errs"], r[f"{what}_noise"]
            assert sorted(errs) == r["params"], (what, sorted(errs))
            for name, err in errs.items():
                bound = max(RTOL, noise * drift[name])
                assert err <= bound, (what, name, err, bound, r["stage"])
        assert r["moved"] > 1e-4, r  # the steps changed the parameters
    embed, tail = (set(names) for names in rks[0]["want_ends"])
    for r in rks:  # what the stage modules held, their parameters after the steps
        if any(first for _, first, _ in r["stages"]):
            assert embed <= set(r["params"]), r["params"]
        if any(last for _, _, last in r["stages"]):
            assert tail <= set(r["params"]), r["params"]
        else:
            assert not tail & set(r["params"]), r["params"]
    # What crosses the boundary: this tp rank's hidden shard, to the same tp rank.
    shard = [batch // dp // m, 16, D_MODEL // tp]
    for r in rks:
        assert r["boundary_shape"] == shard
        assert r["boundary_bytes"] == shard[0] * shard[1] * shard[2] * 4
        # m activations per boundary ahead of each stage, m gradients per one behind it
        boundaries = sum((not first) + (not last) for _, first, last in r["stages"])
        assert len(r["sends"]) == steps * m * boundaries, r["stages"]
        peer_stage = 1 if r["stage"] == 0 else 0
        (peer,) = [q for q in rks if q["stage"] == peer_stage and q["tp_rank"] == r["tp_rank"]
                   and q["dp_rank"] == r["dp_rank"]]  # fmt: skip
        for shape, nbytes, dst in r["sends"]:
            assert shape == shard and nbytes == r["boundary_bytes"], r["sends"]
            assert dst == peer["global_rank"], (r, peer)


def test_pp2_tp2_is_exact_and_sends_shards(four: dict) -> None:
    res = result_of(four, "pp2dp1tp2")
    _check_exact(res, 2, 1, 2, 2)
    full_bytes = 2 * 16 * D_MODEL * 4
    print("pp=2 tp=2: bytes per micro-batch across the boundary, per tp rank:",
          res["boundary_bytes"], f"(full hidden {full_bytes})")  # fmt: skip
    assert res["boundary_bytes"] * 2 == full_bytes
    # the cost model's figure is the measured one (the gathers: see the next test)
    model = pipeline_boundary_bytes(4, 16, D_MODEL, 2, 2)
    assert (model.p2p, model.tp_gather) == (res["boundary_bytes"], 0)


def _hidden_gathers(events: list, shard: list[int]) -> int:
    return sum(1 for name, shapes in events if name == "gloo:all_gather" and shapes == [shard])


@pytest.mark.parametrize("key", ["pp2dp1tp2", "pp2dp1tp2/compiled", "hf/pp2dp1tp2"])
def test_stage_boundaries_add_no_all_gather(four: dict, key: str) -> None:
    """What gloo ran, on every rank: per micro-batch, the two stages together all-gather
    the hidden state ``[b/m, s, d/tp]`` exactly as often as the whole model parallelized
    over the same tp group does (its layers' own gathers): a stage boundary adds none,
    forward or backward; the P2P wire carries one shard each way."""
    _needs_hf(key)
    rks = result_of(four, key)["ranks"]
    m, shard = 2, [2, 16, D_MODEL // 2]
    for tp_rank in (0, 1):
        mine = [r for r in rks if r["tp_rank"] == tp_rank]
        per_mb = sum(_hidden_gathers(r["gloo"], shard) for r in mine) / m
        whole = {_hidden_gathers(r["whole_gloo"], shard) for r in mine}
        assert len(whole) == 1 and per_mb == whole.pop(), (per_mb, mine[0]["whole_gloo"])
        for r in mine:
            sends = [(n, sh) for n, sh in r["gloo"] if n == "gloo:send"]
            assert sends == [("gloo:send", [shard])] * m, sends


def test_pp2_tp2_compiled_stages_are_exact(four: dict) -> None:
    """Each stage's forward through the boost backend (its BTP plan at tp=2): loss,
    gathered gradients and parameters after 2 steps equal one eager device's; every rank
    compiled graphs, and the boundary still carries shards."""
    res = result_of(four, "pp2dp1tp2/compiled")
    _check_exact(res, 2, 1, 2, 2)
    assert all(r["compiled_graphs"] > 0 for r in res["ranks"]), res["ranks"]
    assert all(r["compiled_graphs"] == 0 for r in result_of(four, "pp2dp1tp2")["ranks"])


def test_pp2_tp1_is_exact(two: dict) -> None:
    _check_exact(result_of(two, "pp2dp1tp1"), 2, 1, 1, 2)


def test_pp2_gpipe_adamw_is_exact(two: dict) -> None:
    _check_exact(result_of(two, "pp2dp1tp1/gpipe-adamw"), 2, 1, 1, 2)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
def test_pp2_virtual_stage_schedules_are_exact(two: dict, schedule: str) -> None:
    """torch's interleaved 1F1B and zero-bubble (ZB1P) schedules, 2 stages of one layer per
    rank placed round-robin (rank 0: stages 0 and 2): exact against one device, and each
    rank sends its shard across each of its three stage boundaries per micro-batch."""
    res = result_of(two, f"pp2dp1tp1/{schedule}")
    _check_exact(res, 2, 1, 1, 4)
    assert [r["stages"] for r in res["ranks"]] == [[[0, True, False], [2, False, False]],
                                                   [[1, False, False], [3, False, True]]]  # fmt: skip


def test_pp2_tp2_zero_bubble_is_exact(four: dict) -> None:
    """Zero bubble's split backward (input gradients first, weight gradients later) over
    eager BTP stages at tp=2: the gradients still equal one device's."""
    _check_exact(result_of(four, "pp2dp1tp2/zero-bubble"), 2, 1, 2, 4)


@pytest.mark.skipif(not FULL, reason="compiles 4 stages on 4 ranks (minutes on 2 cores)")
def test_pp2_tp2_compiled_interleaved_is_exact(four: dict) -> None:
    res = result_of(four, "pp2dp1tp2/interleaved-compiled")
    _check_exact(res, 2, 1, 2, 4)
    assert all(r["compiled_graphs"] > 0 for r in res["ranks"]), res["ranks"]


def test_schedules_refuse_what_they_cannot_run() -> None:
    """Refused by name before anything is built: an unknown schedule, virtual stages for a
    one-stage schedule, zero bubble over compiled stages (its backward split needs the
    stage's own autograd graph), a micro-batch count the interleaved rounds do not divide."""
    from boost_compiler.train import TrainConfig
    from boost_compiler.train.config import TrainConfigError
    from boost_compiler.train.schedules import check_schedule

    check_schedule("interleaved-1f1b", 2, 4, 2, compile=True)
    check_schedule("zero-bubble", 2, 4, 2, compile=False)
    with pytest.raises(PipelineError, match="unknown schedule 'zb'"):
        check_schedule("zb", 2, 4, 2, compile=False)
    with pytest.raises(PipelineError, match="1f1b runs one stage per rank, not 2"):
        check_schedule("1f1b", 2, 4, 2, compile=False)
    with pytest.raises(PipelineError, match="zero-bubble splits the backward of eager stages"):
        check_schedule("zero-bubble", 2, 4, 2, compile=True)
    with pytest.raises(PipelineError, match="5 micro-batches are not a multiple of its rounds"):
        check_schedule("interleaved-1f1b", 2, 5, 2, compile=False)
    with pytest.raises(TrainConfigError, match="--no-compile"):
        TrainConfig(pp=2, schedule="zero-bubble").validate()
    with pytest.raises(TrainConfigError, match="2 x 2 stage.s. per rank is 4"):
        TrainConfig(pp=2, schedule="interleaved-1f1b", pp_layers=(1, 1)).validate()
    # the default micro-batch count is one the interleaved rounds divide
    cfg = TrainConfig(pp=2, batch=10, schedule="interleaved-1f1b", compile=False)
    assert cfg.micro_batches(1) == 10  # not 5: 5 % (5 // 2) != 0


def test_pp2_tp1_hf_llama_is_exact(two: dict) -> None:
    """A transformers Llama (to_low_rank cola) split by decoder layer: loss, gradients and
    parameters after 2 SGD steps (1F1B, 2 micro-batches) equal one device's."""
    _needs_hf("hf/")
    res = result_of(two, "hf/pp2dp1tp1")
    print("hf pp=2 tp=1: worst loss / grad / param error:",
          max(r["loss"] for r in res["ranks"]), max(r["grad"] for r in res["ranks"]),
          max(r["param"] for r in res["ranks"]))  # fmt: skip
    _check_exact(res, 2, 1, 1, 2, model="hf")


def test_pp2_tp2_hf_llama_is_exact_and_sends_shards(four: dict) -> None:
    _needs_hf("hf/")
    res = result_of(four, "hf/pp2dp1tp2")
    print("hf pp=2 tp=2: worst loss / grad / param error:",
          max(r["loss"] for r in res["ranks"]), max(r["grad"] for r in res["ranks"]),
          max(r["param"] for r in res["ranks"]))  # fmt: skip
    _check_exact(res, 2, 1, 2, 2, model="hf")
    assert all(r["compiled_graphs"] > 0 for r in res["ranks"]), res["ranks"]


@pytest.mark.parametrize(
    "key", ["train/pp2", "train/pp2-layers", "train/pp2-zero-bubble", "train/hf-pp2"]
)
def test_trainer_pp_path_matches_one_process(
    two: dict, llama_config: str | None, held_out: str, key: str
) -> None:
    """``train(pp=2)``: losses and clipped-norm inputs equal tp=pp=1's eager ones (the
    packaged CoLA-LLaMA, and ``--hf-config`` with a transformers Llama). ``train/pp2`` is
    ``--pp 2`` with no other flag: compiled stages, the default micro-batch count.
    ``train/pp2-layers`` also validates on ``--eval-data`` through the schedule: every
    rank's held-out loss equals one process's. ``train/pp2-zero-bubble``: ``--schedule
    zero-bubble``, 4 stages of one layer (2 per rank), eager."""
    from boost_compiler.train import TrainConfig, train
    from tests.pipeline_checks import TRAIN, _eval_flags, _layers

    _needs_hf(key)
    res = result_of(two, key)
    hf = {"hf_config": llama_config} if key == "train/hf-pp2" else {}
    evals = _eval_flags(held_out if key == "train/pp2-layers" else None)
    layers = _layers(4 if key == "train/pp2-zero-bubble" else None)
    want = train(TrainConfig(**TRAIN, compile=False, progress=False, model_overrides=layers,
                             **hf, **evals))  # fmt: skip
    if evals:  # at steps 1 (every 2) and 2 (the last)
        assert sorted(want.eval_losses) == [1, 2], want.eval_losses
    for r in res["ranks"]:
        got_evals = {int(k): v for k, v in r["eval_losses"].items()}
        assert sorted(got_evals) == sorted(want.eval_losses), (got_evals, want.eval_losses)
        for s, v in got_evals.items():
            assert abs(v - want.eval_losses[s]) <= 1e-5 * abs(want.eval_losses[s]), got_evals
        got = {int(k): v for k, v in r["losses"].items()}
        norms = {int(k): v for k, v in r["grad_norms"].items()}
        assert sorted(got) == [0, 1, 2]
        for s in got:
            assert abs(got[s] - want.losses[s]) <= 1e-5 * abs(want.losses[s]), (got, want.losses)
            assert abs(norms[s] - want.grad_norms[s]) <= 1e-5 * want.grad_norms[s]
    assert want.grad_norms[0] > 0.5  # clipping was active
    if key == "train/pp2":
        assert all(r["compiled_graphs"] > 0 for r in res["ranks"]), res["ranks"]
    if key == "train/pp2-layers":  # --pp-layers 2,0: the last stage is the norm and head alone
        assert all(r["stages"] == [[[0, 1], []]] for r in res["ranks"]), res["ranks"]


def test_pp2_hf_checkpoint_exports_the_one_process_model(
    two: dict, llama_config: str | None, tmp_path: Path
) -> None:
    """The ``--pp 2 --hf-config`` run's checkpoint (each stage saved its own layers) holds one
    transformers model: ``boost export --format hf`` of it, loaded by ``from_pretrained``,
    has the parameters of the same run on one process, within 1e-5 relative."""
    _needs_hf("train/hf")
    import boost_compiler
    from boost_compiler.train import TrainConfig, train
    from boost_compiler.train.hf_model import export_hf
    from tests.pipeline_checks import TRAIN
    from tests.tp_harness import _rel

    (ck,) = {r["checkpoint"] for r in result_of(two, "train/hf-pp2")["ranks"]}
    export_hf(ck, tmp_path / "exported")
    got = boost_compiler.from_pretrained(str(tmp_path / "exported")).state_dict()
    want = train(TrainConfig(**TRAIN, compile=False, progress=False, hf_config=llama_config))
    assert want.model is not None
    ref = want.model.state_dict()
    assert set(got) == set(ref)
    errs = {k: _rel(got[k], ref[k]) for k in ref}
    assert max(errs.values()) <= RTOL, max(errs, key=errs.__getitem__)


def test_pp2_padded_qwen3_is_exact(two: dict) -> None:
    """Qwen3 (a zoo family, found by structure) on left-padded rows of different lengths:
    every micro-batch holds a different number of labelled tokens, and the pipelined
    loss, gradients and parameters still equal one device's on the whole batch."""
    _needs_hf("hf/")
    res = result_of(two, "zoo/qwen3-padded")
    _check_exact(res, 2, 1, 1, 2, model="zoo")


# Per tensor, norm-relative, over 3 steps: compiled pp=2 x tp=2 against one device, and a
# single-device twin perturbed by 1e-7 against the same device. Measured: every gradient
# and parameter within 9.2e-6 of its norm, at most 2.4x its twin's drift (Qwen3's last
# k_proj down factor: 6.9e-6 against 2.9e-6); the gradients' drifts are 7.5e-7 to 1.3e-5.
PP_NOISE = 4.0


@pytest.mark.skipif(not FULL, reason="compiles 4 ranks (minutes on 2 cores)")
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_pp2_tp2_compiled_hf_families_are_exact(family: str) -> None:
    """pp=2 x tp=2, compiled stages, padded batches, 3 steps: Qwen3 and Gemma 3. Inductor
    reorders float32 sums more than eager BTP does, and these tiny models amplify rounding
    step by step: measured on the largest element, worst gradient 1.2e-5 (Qwen3) and 1.7e-5
    (Gemma 3), where a single-device twin perturbed by 1e-7 drifts 3.9e-6 and 9.6e-6. So
    each gradient and parameter is held, relative to its own norm, to 1e-5 or
    PP_NOISE x the twin's drift on that same tensor, whichever is larger (not one drift,
    the noisiest tensor's, for all); a wrong plan is off by 1e-3 and more."""
    need("transformers")
    kw = {"model": f"zoo:{family}", "padded": True, "compile": True, "steps": 3, "lr": 1e-3,
          "noise": True}  # fmt: skip
    res = result_of(run_world(4, [(family, FN, (2, 1, 2, 2), kw)]), family)
    noise = max(r["noise"] for r in res["ranks"])
    assert 0 < noise < 3e-5, noise  # the twin measured something, and little
    _check_exact(res, 2, 1, 2, 2, model="zoo", steps=3, noise=PP_NOISE)
    assert all(r["compiled_graphs"] > 0 for r in res["ranks"]), res["ranks"]


# Tiny models amplify float32 rounding even at lr 1e-3: a single-device twin perturbed by
# 1e-7 differs by 3.2e-5 in OLMo 2's gradients after one step (its stages match one device
# to 7e-13 in float64), by 1.7e-5 in Qwen2's on transformers 5.25 (its worst tensor 8.7e-6
# against the twin's 8.9e-6). Each family is bounded by its own twin, tensor by tensor.
FAMILIES_TP = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3",
               "olmo2", "cohere", "stablelm", "starcoder2", "gpt_neox", "mixtral", "qwen3_moe",
               "deepseek_v3")  # fmt: skip


@pytest.fixture(scope="module")
def families() -> dict:
    """Every family the stage split accepts, pp=2 x tp=2 eager, 3 SGD steps at lr 1e-3
    (the zoo's: HF's initialisation makes these tiny models chaotic under large steps)."""
    from boost_compiler.train.pipeline_hf import CHECKED

    kinds = {"gemma3_text": "gemma3"}
    checks = [(f, FN, (2, 1, 2, 2), {"model": f"zoo:{kinds.get(f, f)}", "steps": 3,
                                      "lr": 1e-3, "noise": True}) for f in CHECKED]  # fmt: skip
    return run_world(4, checks)


@pytest.mark.skipif(not FULL, reason="16 families on 4 ranks (minutes on 2 cores)")
@pytest.mark.parametrize("family", FAMILIES_TP)
def test_pp2_tp2_every_family_is_exact(families: dict, family: str) -> None:
    """Stages of every accepted family under BTP at tp=2 equal one device (each rank)."""
    need("transformers")
    res = result_of(families, family)
    _check_exact(res, 2, 1, 2, 2, model="zoo", steps=3, noise=PP_NOISE)


def test_every_accepted_family_is_checked_at_tp2() -> None:
    need("transformers")
    from boost_compiler.train.pipeline_hf import CHECKED

    assert set(FAMILIES_TP) == set(CHECKED)


@pytest.mark.skipif(not FULL, reason=FULL_REASON)
@pytest.mark.parametrize("model", ["cola", "hf"])
def test_pp2_dp2_is_exact(four: dict, model: str) -> None:
    """FSDP2 over dp shards each stage per block (tp = 1): one unit per layer, and the
    stage; still exact (issue 42)."""
    if model == "hf" and not HAS_HF:
        pytest.skip("needs transformers")
    res = result_of(four, "pp2dp2tp1" if model == "cola" else "hf/pp2dp2tp1")
    _check_exact(res, 2, 2, 1, 2, batch=8, model=model)
    assert {r["fsdp_units"] for r in res["ranks"]} == {2 + 1}  # 2 layers per stage


@pytest.mark.skipif(not FULL, reason=FULL_REASON)
def test_pp2_dp2_tp2_is_exact() -> None:
    res = result_of(run_world(8, [("pp2dp2tp2", FN, (2, 2, 2, 2), {"batch": 8})]), "pp2dp2tp2")
    _check_exact(res, 2, 2, 2, 2, batch=8)


def test_cost_model_boundary_bytes() -> None:
    assert pipeline_boundary_bytes(8, 4096, 4096, 4, 4, 2).p2p == 2 * 4096 * 1024 * 2
    assert pipeline_boundary_bytes(4, 16, 64, 2, 2).tp_gather == 0  # the stages take shards
    with pytest.raises(ValueError, match="divide"):
        pipeline_boundary_bytes(3, 16, 64, 2, 2)


def test_split_layers() -> None:
    assert [s.layers for s in split_layers(4, 2)] == [(0, 1), (2, 3)]
    # the extra layers go to the middle stages first (the ends hold embedding / head)
    assert [len(s.layers) for s in split_layers(4, 3)] == [1, 2, 1]
    assert [len(s.layers) for s in split_layers(5, 3)] == [2, 2, 1]
    assert [s.layers for s in split_layers(3, 2, [1, 2])] == [(0,), (1, 2)]
    assert split_layers(3, 2)[1].last and split_layers(3, 2)[0].first
    with pytest.raises(PipelineError, match="summing to 3"):
        split_layers(3, 2, [1, 1])
    with pytest.raises(PipelineError, match="middle stage"):
        split_layers(2, 3, [1, 0, 1])


@pytest.mark.parametrize("kind", ["cola", "hf", "zoo:qwen3"])
def test_stage_modules_hold_the_models_ends(kind: str) -> None:
    """In one process: the modules the split builds for 3 stages (``CoLAStage``,
    ``hf_stage``) hold, besides their layers, the whole model's embedding (the first),
    its final norm and head (the last) and nothing else (the middle): what
    ``_check_ends`` checks on every rank of the pipelined runs, read off the models."""
    from boost_compiler.train.spec_cola import CoLAStage
    from tests.pipeline_checks import _models, model_ends, stage_ends

    if kind != "cola":
        need("transformers")
    from boost_compiler.train.pipeline_hf import hf_stage

    model = _models(kind, 3)[0]
    specs = split_layers(3, 3)
    stages = [CoLAStage(model, s) if kind == "cola" else hf_stage(model, s) for s in specs]
    want = model_ends(kind, model)
    assert stage_ends(specs, stages) == [*want, []]
    if kind in ENDS:
        assert tuple(set(names) for names in want) == ENDS[kind]


def _chain(family: str, checked: bool = True) -> tuple[Any, Any, list[Any], Any]:
    """The 3 stages of a 6-layer zoo ``family`` (CoLA, untied head; where the config has
    per-layer types, a mix of sliding and full attention, so a stage that indexed them by
    its own loop position would pick the wrong mask), run one after the other on a padded
    batch with position ids, and the whole model on the same batch: (loss, whole loss,
    stages, whole model)."""
    import copy

    import torch

    from boost_compiler.train.pipeline_hf import hf_stage
    from tests import zoo_checks

    kinds = ["sliding_attention"] * 2 + ["full_attention"] * 3 + ["sliding_attention"]
    mixed = {"layer_types": kinds, "sliding_window": 4,
             "use_sliding_window": True, "max_window_layers": 6}  # fmt: skip
    base = zoo_checks.build(family, tie_word_embeddings=False, num_hidden_layers=6)
    extra = mixed if getattr(base.config, "layer_types", None) is not None else {}
    model = zoo_checks.build(family, tie_word_embeddings=False, num_hidden_layers=6, **extra)
    ref = copy.deepcopy(model)
    stages = [hf_stage(model, s, checked) for s in split_layers(6, 3)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)
    hidden = ids
    for st in stages[:-1]:
        hidden = st(hidden, attention_mask=mask, position_ids=pos)
    loss = stages[-1](hidden, labels=labels, attention_mask=mask, position_ids=pos)
    want = ref(ids, attention_mask=mask, position_ids=pos, labels=labels, use_cache=False).loss
    return loss, want, stages, ref


CHAIN_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3",
                  "olmo2", "cohere", "stablelm", "starcoder2", "gpt_neox", "mixtral",
                  "qwen3_moe", "deepseek_v3"]  # fmt: skip


@pytest.mark.parametrize("family", CHAIN_FAMILIES)
def test_hf_stages_chain_to_the_whole_model(family: str) -> None:
    """In one process: a family's 3 stages, chained, give the whole model's loss and
    gradients on a padded batch, under the whole model's names; every zoo family with a
    dense decoder stack, and the list the stage builder accepts is exactly these."""
    need("transformers")
    import torch

    from boost_compiler.train.pipeline_hf import CHECKED

    loss, want, stages, ref = _chain(family)
    assert stages[0].config.model_type in CHECKED
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=0)
    loss.backward()
    want.backward()
    ref_params = dict(ref.named_parameters())
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(ref_params)  # each parameter in exactly one stage
    for st in stages:
        for name, prm in st.named_parameters():
            torch.testing.assert_close(prm.grad, ref_params[name].grad, rtol=RTOL, atol=1e-8)
    first = sorted(stages[1].state_dict())[0]
    assert first.startswith(f"{ref.base_model_prefix}.layers.2."), first  # global indices


def test_checked_families_are_the_chain_tests() -> None:
    need("transformers")
    from boost_compiler.train.pipeline_hf import CHECKED
    from tests import zoo_checks

    kinds = {zoo_checks.build(f).config.model_type for f in CHAIN_FAMILIES}
    assert kinds == set(CHECKED)


def test_hf_stages_refuse_other_layouts() -> None:
    """Granite (its base model scales inputs_embeds: refused, and its stages forced past
    the refusal indeed do not chain), GPT-2 (learned positions beside the layers), and a
    head tied to the embedding."""
    need("transformers")
    from boost_compiler.train.pipeline_hf import hf_dims, hf_stage
    from tests.models import hf_decoder

    with pytest.raises(PipelineError, match="'granite'.*embedding_multiplier"):
        _chain("granite")
    loss, want, _, _ = _chain("granite", checked=False)
    assert abs(loss.item() - want.item()) > 1e-4 * abs(want.item())  # the refusal's reason
    with pytest.raises(PipelineError, match="'gpt2'"):
        hf_stage(hf_decoder("gpt2"), split_layers(2, 2)[0])
    with pytest.raises(PipelineError, match=r"\['wpe', 'ln_f'\] hold parameters"):
        hf_stage(hf_decoder("gpt2"), split_layers(2, 2)[0], checked=False)
    assert hf_dims(hf_decoder("llama")) == (2, 64, False)
    assert hf_dims(hf_decoder("llama", tie_word_embeddings=True))[2]
