"""Smoke tests of the benchmarks (``boost_compiler/bench/``, ``boost bench``): fast, tiny sizes only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from boost_compiler import costmodel as cm
from boost_compiler.bench import gemm
from boost_compiler.bench import suite as bench
from boost_compiler.bench.harness import ModelSpec, spawn

ROOT = Path(__file__).resolve().parents[1]
TINY = bench.SIZES["tiny"]
ONE_LAYER = ModelSpec(d=64, ff=172, rank=16, layers=1, heads=4, batch=2, seq=16)


def test_gemm_microbench_tiny() -> None:
    (res,) = gemm.run(["tiny"], tp=2, threads=1, min_time=0.001)
    st = res["strategies"]
    assert list(st) == ["dense", "standard", "btp", "boost"]
    # the same logical layer: standard TP and BTP do the same FLOPs per rank
    assert st["standard"]["flops"] == st["btp"]["flops"] == st["boost"]["flops"]
    # K = r/p for standard TP's up factor, d/p (>= r) for BTP's down factor
    assert st["standard"]["min_k"] == 16 // 2
    assert st["btp"]["min_k"] == 16
    up_q = next(g for g in st["standard"]["gemms"] if g["name"] == "q.A")
    assert (up_q["M"], up_q["K"], up_q["N"]) == (64, 8, 64)
    assert up_q["intensity"] == pytest.approx(float(cm.arithmetic_intensity(64, 8, 64, 4)))
    assert all(s["gflops"] > 0 and s["seconds"] > 0 for s in st.values())
    assert st["btp"]["intensity"] > st["standard"]["intensity"]
    gemm.table([res])  # renders


def test_gpu_script_fails_fast_without_gpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU available" in proc.stderr


def test_predictions_tiny() -> None:
    """The cost-model prediction per step, by hand for the tiny size (tp=2, fp32, 64 tokens)."""
    t, r, d, ff, L = TINY.tokens, TINY.rank, TINY.d, TINY.ff, TINY.layers
    lowrank = bench.predict("dtensor-lowrank", TINY, 2)
    assert lowrank["fwd_bytes"] == L * t * (5 * d + 2 * ff) * 4
    assert lowrank["bwd_bytes"] == L * t * (6 * d + ff) * 4
    assert (lowrank["fwd_count"], lowrank["bwd_count"]) == (7 * L, 7 * L)
    dense = bench.predict("dtensor-dense", TINY, 2)
    assert (dense["fwd_bytes"], dense["bwd_bytes"]) == (L * t * 2 * d * 4, L * t * 5 * d * 4)
    boost = bench.predict("boost", TINY, 2)
    fwd_stats = 2 if boost["formula"] in ("boost", "btp") else 0
    # L x 7r latents (+ 2 norm statistics), the vocabulary-parallel head's all-gather
    # [b, s, d], final-norm stats, and the loss's max + [sum exp, target] per shifted token
    loss_tokens = TINY.batch * (TINY.seq - 1)
    assert boost["fwd_bytes"] == (
        L * t * (7 * r + fwd_stats) * 4 + t * d * 4 + t * 4 + loss_tokens * 3 * 4
    )
    # backward: L x 7r latents (+ stats), final-norm stats, the head input's gradient [b, s, d]
    bwd_stats = 2 if boost["formula"] == "btp" else 0
    assert boost["bwd_bytes"] == L * t * (7 * r + bwd_stats) * 4 + t * 4 + t * d * 4


def test_analyse_ratios_and_match() -> None:
    def res(step: float, comm_bytes: tuple[int, int] | None = None) -> dict[str, Any]:
        r: dict[str, Any] = {
            "step_times": [[step / 2, step / 4, step / 4, step]] * 3,
            "first_step_s": 1.0,
            "losses": [5.0, 4.0],
        }
        if comm_bytes:
            r["comm"] = {
                "count": 3, "bytes": sum(comm_bytes),
                "fwd": {"count": 2, "bytes": comm_bytes[0]},
                "bwd": {"count": 1, "bytes": comm_bytes[1]},
            }  # fmt: skip
        return {"sizes": {"tiny": r}, "per_rank": []}

    pred = bench.predict("dtensor-lowrank", TINY, 2)
    results = {
        "boost": res(0.1, (1, 2)),
        "dtensor-lowrank": res(0.3, (pred["fwd_bytes"], pred["bwd_bytes"])),
        "eager": res(0.2),
    }
    rows = bench.analyse(results, ["tiny"], 2)["tiny"]
    assert rows["dtensor-lowrank"]["boost_speedup"] == pytest.approx(3.0)
    assert rows["eager"]["boost_speedup"] == pytest.approx(2.0)
    assert rows["dtensor-lowrank"]["bytes_match"] is True
    assert rows["boost"]["bytes_match"] is False
    assert rows["boost"]["tokens_per_s"] == pytest.approx(TINY.tokens / 0.1)
    assert rows["boost"]["loss_vs_eager"] == 0.0
    bench.comm_table({"tiny": rows}, 2)
    bench.time_table({"tiny": rows}, 2)


def test_split_group() -> None:
    group = {
        "sizes": {"tiny": {"boost": {"x": 1}, "eager": {"error": "boom"}}},
        "per_rank": [{"rank": 0, "sizes": {"tiny": {"boost": {"x": 1}}}}],
        "wall_s": 3.0,
    }
    out = bench.split_group(group, ["boost", "eager"])
    assert out["boost"]["sizes"] == {"tiny": {"x": 1}}
    assert out["boost"]["per_rank"] == [{"rank": 0, "sizes": {"tiny": {"x": 1}}}]
    assert out["eager"]["sizes"]["tiny"] == {"error": "boom"}


def comm_check(*, rank: int, world: int, mesh: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Spawned: one eager profiled step of each strategy at the tiny size; measured vs predicted."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from boost_compiler.bench.harness import (
        BACKWARD_MARK,
        count_collectives,
        make_model,
        parallelize,
    )
    from boost_compiler.models.cola_llama import example_inputs

    ms = ModelSpec(**spec)
    out = {}
    for strategy in ("boost", "dtensor-lowrank", "dtensor-dense"):
        model = make_model(strategy, ms)
        (ids,) = example_inputs(model.cfg, batch=ms.batch, seq=ms.seq)
        parallelize(strategy, model, mesh, ids, world)
        model(ids, labels=ids).backward()  # warm-up
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            loss = model(ids, labels=ids)
            with record_function(BACKWARD_MARK):
                loss.backward()
        torch.distributed.barrier()
        c = count_collectives(prof, world)
        out[strategy] = {
            "measured": [c["fwd"]["bytes"], c["bwd"]["bytes"], c["fwd"]["count"], c["bwd"]["count"]]
        }
    return out


def test_comm_counting_matches_cost_model_tiny() -> None:
    """2 processes, eager, 1-layer tiny CoLA-LLaMA: profiler gloo bytes == the cost model's."""
    res = spawn(
        "tests.test_bench:comm_check", 2, {"spec": ONE_LAYER.as_dict()}, timeout_s=240, tag="test"
    )
    assert "error" not in res, res.get("traceback")
    for strategy in ("boost", "dtensor-lowrank", "dtensor-dense"):
        p = bench.predict(strategy, ONE_LAYER, 2)
        assert res[strategy]["measured"][:2] == [p["fwd_bytes"], p["bwd_bytes"]], strategy
        assert res[strategy]["measured"][2:] == [p["fwd_count"], p["bwd_count"]], strategy


def test_cli_registers_bench(tmp_path: Path) -> None:
    from boost_compiler import cli

    assert "bench" in cli.COMMANDS
    args = cli.build_parser("bench").parse_args(["bench", "--sizes", "tiny", "--out", "x"])
    assert (args.sizes, args.steps, args.tp) == ("tiny", 10, 2)
    # a bad size is reported as `boost bench: error: ...`, exit status 2, before any work
    assert cli.main(["bench", "--sizes", "nope", "--out", str(tmp_path)]) == 2


def test_plots_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.plots({}, [], tmp_path) == []
    assert "matplotlib is not installed: PNG charts skipped" in capsys.readouterr().out
