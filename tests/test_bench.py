"""Smoke tests of the benchmarks (``boost_compiler/bench/``, ``boost bench``): fast, tiny sizes only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from boost_compiler import costmodel as cm
from boost_compiler.bench import gemm, peers
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


@pytest.mark.skipif(os.environ.get("BOOST_FULL_TESTS") != "1",
                    reason="compiles the tiny preset 7 times (4 minutes); BOOST_FULL_TESTS=1")  # fmt: skip
def test_gpu_script_dry_run_starts_every_part(tmp_path: Path) -> None:
    """``gpu.sh --dry-run``: every part of the prepared GPU run (compiled training with both
    backends, the GEMM microbench, the BTP layer on the fake process group, the trainer
    under mixed precision, the symm_mem part's 2-rank worker) runs on the
    CPU at toy sizes, with no error recorded and BTP's layer planned with no fallback."""
    import json

    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=470, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "gpu.json").read_text())
    assert set(rec["train"]) == {"boost", "inductor"}
    assert not any("error" in r for r in rec["train"].values()), rec["train"]
    assert rec["gemm"] and {"dense", "standard", "btp", "boost"} <= set(
        rec["gemm"][0]["strategies"]
    )
    assert "error" not in rec["btp"] and rec["btp"]["fallbacks"] == [], rec["btp"]
    assert rec["btp"]["btp_step_s"] > 0 and rec["btp"]["collectives"], rec["btp"]
    # boost train --mixed-precision bf16 ran steps past its warm-up, and it learned
    mixed = rec["mixed"]
    assert "error" not in mixed and mixed["steps"] >= 1 and mixed["tokens_per_s"] > 0, mixed
    # the symm_mem part's torchrun worker: both ranks stepped, the same losses (gloo, option off)
    off = rec["symm"]["nccl"]["ranks"]
    assert len(off) == 2 and off[0]["losses"] == off[1]["losses"], rec["symm"]


def test_predictions_tiny() -> None:
    """The cost-model prediction per step, by hand for the tiny size (tp=2, fp32, 64 tokens)."""
    t, r, d, ff, L = TINY.tokens, TINY.rank, TINY.d, TINY.ff, TINY.layers
    lowrank = bench.predict("dtensor-lowrank-nosp", TINY, 2)
    assert lowrank["fwd_bytes"] == L * t * (5 * d + 2 * ff) * 4
    assert lowrank["bwd_bytes"] == L * t * (6 * d + ff) * 4
    assert (lowrank["fwd_count"], lowrank["bwd_count"]) == (7 * L, 7 * L)
    dense = bench.predict("dtensor-dense-nosp", TINY, 2)
    assert (dense["fwd_bytes"], dense["bwd_bytes"]) == (L * t * 2 * d * 4, L * t * 5 * d * 4)
    boost = bench.predict("boost", TINY, 2)
    fwd_stats = 2 if boost["formula"] in ("boost", "btp") else 0
    # L x 7r latents (+ 2 norm statistics), the vocabulary-parallel head's all-gather
    # [b, s, d], final-norm stats, and the loss's all-gathered [log-sum-exp, target term]
    # per token from each of the 2 ranks (the labels are shifted: every position is there)
    loss_tokens = TINY.tokens
    assert boost["fwd_bytes"] == (
        L * t * (7 * r + fwd_stats) * 4 + t * d * 4 + t * 4 + loss_tokens * 2 * 2 * 4
    )
    # backward: L x 7r latents (+ stats), final-norm stats, the head input's gradient [b, s, d]
    bwd_stats = 2 if boost["formula"] == "btp" else 0
    assert boost["bwd_bytes"] == L * t * (7 * r + bwd_stats) * 4 + t * 4 + t * d * 4


def test_predictions_torchtitan_tiny() -> None:
    """torchtitan's plans by hand: per layer all-gathers (AG) and reduce-scatters (RS) of
    [t, d] around each sub-block; outside: embedding RS, head AG, 3 loss statistics."""
    t, d, ff, L = TINY.tokens, TINY.d, TINY.ff, TINY.layers
    loss = 3 * TINY.tokens * 4
    norms = (2 * L + 1) * d * 4  # the norm weights' Partial gradients, reduced at AdamW
    dense = bench.predict("dtensor-dense", TINY, 2)
    assert dense["fwd_bytes"] == L * 4 * t * d * 4 + 2 * t * d * 4 + loss
    assert dense["bwd_bytes"] == L * 4 * t * d * 4 + 2 * t * d * 4 + norms
    assert (dense["fwd_count"], dense["bwd_count"]) == (4 * L + 5, 4 * L + 2 + 2 * L + 1)
    lowrank = bench.predict("dtensor-lowrank", TINY, 2)
    # forward: AG x 2 + AR q, k, v + AR gate, up + RS o, down; backward: RS x 2, AG x 2,
    # AR of the o.down and down.down input gradients
    assert (
        lowrank["fwd_bytes"] == L * t * (2 * d + 3 * d + 2 * ff + 2 * d) * 4 + 2 * t * d * 4 + loss
    )
    assert lowrank["bwd_bytes"] == L * t * (5 * d + ff) * 4 + 2 * t * d * 4 + norms
    assert (lowrank["fwd_count"], lowrank["bwd_count"]) == (9 * L + 5, 6 * L + 2 + 2 * L + 1)
    eager = peers.predict("dtensor-dense", TINY, 2, optimizer=False)
    assert eager["bwd_bytes"] == dense["bwd_bytes"] - norms


def test_analyse_ratios_and_match() -> None:
    def res(
        step: float, comm_bytes: tuple[int, int] | None = None, world: int = 2, state: int = 0
    ) -> dict[str, Any]:
        mem = {"param_bytes": state, "grad_bytes": state, "adamw_bytes": 2 * state,
               "state_bytes": 4 * state, "step_peak_bytes": 100, "peak_bytes": 3 * state + 100}  # fmt: skip
        r: dict[str, Any] = {
            "step_times": [[step / 2, step / 4, step / 4, step]] * 3,
            "first_step_s": 1.0,
            "losses": [5.0, 4.0],
            "world": world,
            "memory": mem,
            # rank 1 holds more: the table shows the largest rank
            "memory_ranks": [mem, {**mem, "peak_bytes": 3 * state + 200}],
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
        "boost": res(0.1, (1, 2), state=1000),
        "dtensor-lowrank": res(0.3, (pred["fwd_bytes"], pred["bwd_bytes"]), state=3000),
        "eager": res(0.2, world=1, state=4000),
        "inductor": res(0.16, world=1, state=4000),
    }
    rows = bench.analyse(results, ["tiny"], 2)["tiny"]
    assert rows["dtensor-lowrank"]["boost_speedup"] == pytest.approx(3.0)
    assert rows["eager"]["boost_speedup"] == pytest.approx(2.0)
    assert rows["dtensor-lowrank"]["bytes_match"] is True
    assert rows["boost"]["bytes_match"] is False
    assert rows["boost"]["tokens_per_s"] == pytest.approx(TINY.tokens / 0.1)
    assert rows["boost"]["loss_vs_eager"] == 0.0
    # parallel efficiency from the reported medians: T(1 process, Inductor) / (p x T)
    for system, row in rows.items():
        p = 2 if system in ("boost", "dtensor-lowrank") else 1
        assert row["efficiency"] == pytest.approx(rows["inductor"]["step_s"] / (p * row["step_s"]))
    assert rows["boost"]["efficiency"] == pytest.approx(0.16 / (2 * 0.1))
    assert rows["inductor"]["efficiency"] == pytest.approx(1.0)
    mem = rows["dtensor-lowrank"]["memory"]
    assert mem["state_bytes"] == 12000
    assert mem["state_bytes"] == mem["param_bytes"] + mem["grad_bytes"] + mem["adamw_bytes"]
    assert mem["peak_bytes"] == 3 * 3000 + 200  # the worst rank's
    bench.comm_table({"tiny": rows}, 2)
    bench.time_table({"tiny": rows}, 2)
    text = _render(bench.summary_table({"tiny": rows}, 2))
    for column in ("tokens/s", "par. eff.", "state/rank MiB", "peak/rank MiB", "vs BOOST"):
        assert column in text
    # boost's state is 4000 B, dtensor-lowrank's 12000 B: 3.00x; its efficiency 0.16/0.6
    line = next(ln for ln in text.splitlines() if "dtensor-lowrank" in ln)
    assert "3.00x" in line and "0.27" in line


def _render(table: Any) -> str:
    import io

    from rich.console import Console

    console = Console(record=True, width=250, file=io.StringIO())
    console.print(table)
    return console.export_text()


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


STRATEGIES = ("boost", "dtensor-lowrank", "dtensor-dense", "dtensor-lowrank-nosp",
              "dtensor-dense-nosp")  # fmt: skip


def comm_check(*, rank: int, world: int, mesh: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Spawned: one eager profiled step of each strategy at the tiny size; measured vs predicted,
    the vocabulary-parallel head and loss of the torchtitan plans, per-rank state bytes."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile, record_function

    from boost_compiler.bench.harness import (
        BACKWARD_MARK,
        count_collectives,
        make_model,
        parallelize,
        scalar,
    )
    from boost_compiler.bench.training import adamw_bytes, local_bytes, make_optimizer
    from boost_compiler.models.cola_llama import example_inputs

    ms = ModelSpec(**spec)
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        model = make_model(strategy, ms)
        (ids,) = example_inputs(model.cfg, batch=ms.batch, seq=ms.seq)
        ref = float(make_model(strategy, ms)(ids, labels=ids))
        single = 4 * local_bytes(model.parameters())  # params + grads + exp_avg + exp_avg_sq
        parallelize(strategy, model, mesh, ids, world)
        res: dict[str, Any] = {"ref": ref, "single_state_bytes": single}
        with peers.loss_context(strategy):
            peers.compute_loss(strategy, model, ids).backward()  # warm-up
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with peers.loss_context(strategy):
                loss = peers.compute_loss(strategy, model, ids)
                with record_function(BACKWARD_MARK):
                    loss.backward()
        torch.distributed.barrier()
        c = count_collectives(prof, world)
        res["measured"] = [
            c["fwd"]["bytes"],
            c["bwd"]["bytes"],
            c["fwd"]["count"],
            c["bwd"]["count"],
        ]
        res["loss"] = scalar(loss)
        res["shapes"] = c["shapes"]
        if strategy in peers.TORCHTITAN:
            head, embed = model.lm_head.weight, model.embed.weight
            res["head_local"] = list(head.to_local().shape) if isinstance(head, DTensor) else None
            res["embed_local"] = (
                list(embed.to_local().shape) if isinstance(embed, DTensor) else None
            )
            logits = model(ids)
            res["logits"] = [type(logits).__name__, str(logits.placements)]
            res["loss_type"] = type(loss).__name__
            res["labels_call"] = scalar(model(ids, labels=ids))  # gathers the logits
            try:  # without loss_parallel, sharded logits and plain labels do not mix
                peers.compute_loss(strategy, model, ids)
                res["without_loss_parallel"] = "ran"
            except RuntimeError as err:
                res["without_loss_parallel"] = str(err)[:80]
        opt = make_optimizer(model, 1e-3)
        grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        res["state_bytes"] = local_bytes(model.parameters()) + grads + adamw_bytes(opt)
        out[strategy] = res
    return out


def test_comm_counting_matches_cost_model_tiny() -> None:
    """2 processes, eager, 1-layer tiny CoLA-LLaMA: profiler gloo bytes == the cost model's;
    torchtitan's plans are vocabulary-parallel (head [V/p, d], loss under loss_parallel)."""
    res = spawn(
        "tests.test_bench:comm_check", 2, {"spec": ONE_LAYER.as_dict()}, timeout_s=240, tag="test"
    )
    assert "error" not in res, res.get("traceback")
    V, d = ONE_LAYER.vocab, ONE_LAYER.d
    for strategy in STRATEGIES:
        r = res[strategy]
        p = (
            peers.predict(strategy, ONE_LAYER, 2, optimizer=False)
            if strategy in peers.TORCHTITAN
            else bench.predict(strategy, ONE_LAYER, 2)
        )
        assert r["measured"][:2] == [p["fwd_bytes"], p["bwd_bytes"]], strategy
        assert r["measured"][2:] == [p["fwd_count"], p["bwd_count"]], strategy
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5), strategy
        assert r["state_bytes"] < r["single_state_bytes"], strategy
    for strategy in peers.TORCHTITAN:
        r = res[strategy]
        assert r["head_local"] == [V // 2, d] and r["embed_local"] == [V // 2, d], strategy
        assert r["logits"] == ["DTensor", "(Shard(dim=2),)"], strategy
        assert r["loss_type"] == "DTensor", strategy  # loss_parallel's replicated loss
        assert "mixed torch.Tensor and DTensor" in r["without_loss_parallel"], strategy
        assert r["labels_call"] == pytest.approx(r["ref"], rel=1e-5), strategy
        # loss_parallel: 3 per-token statistics [b s, 1], never the [b, s, V] logits
        n = ONE_LAYER.tokens
        assert r["shapes"][f"fwd gloo:all_reduce [{n}, 1] float"] == 3, r["shapes"]
        assert not any(f", {V // 2}]" in k or f", {V}]" in k for k in r["shapes"]), r["shapes"]
    # per rank, the dense model's state under torchtitan's plan is about half the 1-process one
    dense = res["dtensor-dense"]
    assert dense["state_bytes"] < 0.6 * dense["single_state_bytes"]


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


def test_collective_timeline_splits_waits_into_skew_and_transfer() -> None:
    """``benchmarks/collective_timeline.py``: a wait before the peer issued is skew, the
    rest transfer; per rank, on one clock."""
    from benchmarks.collective_timeline import _analyse

    def rank(rows: list[list[float]]) -> dict[str, Any]:  # [issue, wait, done, issuing s, B]
        return {"steps": [{"start": 0.0, "end": 0.010, "log": rows}]}

    early = rank([[0.000, 0.001, 0.005, 0.0002, 4096], [0.006, 0.006, 0.007, 0.0, 4096]])
    late = rank([[0.003, 0.003, 0.005, 0.0001, 4096], [0.006, 0.0065, 0.007, 0.0, 4096]])
    out = _analyse([early, late])
    r0, r1 = out["ranks"]
    assert r0["wait"] == pytest.approx(5.0) and r1["wait"] == pytest.approx(2.5)
    assert r0["skew"] == pytest.approx(2.0) and r1["skew"] == pytest.approx(0.0)
    assert r0["transfer"] == pytest.approx(3.0) and r1["transfer"] == pytest.approx(2.5)
    assert r0["issue"] == pytest.approx(0.2) and r0["step"] == pytest.approx(10.0)
    assert out["worst"][0][:2] == (pytest.approx(3.0), 0)  # 3 ms apart: collective 0


def test_step_faults_rows_sum_the_loss_kernels_of_each_step() -> None:
    """``benchmarks/step_faults.py``: a step's loss is its loss kernels' time, nothing else."""
    from benchmarks.step_faults import rows

    def step(loss_ms: float) -> dict[str, Any]:
        top = {"aten::mm": 700.0, "graph_0_cpp_fused__unsafe_view_logsumexp_mul_0": loss_ms,
               "graph_0_cpp_fused_all_gather_into_tensor_cat_logsumexp_1": 12.0,
               "aten::_scaled_dot_product_flash_attention_for_cpu": 15.0}  # fmt: skip
        return {"wall_ms": 1000.0, "top": top, "other compute": 150.0, "exposed comm": 90.0}

    got = rows([step(11.0), step(95.0)], [0, 16000])
    assert [(r["faults"], r["loss"]) for r in got] == [(0, 23.0), (16000, 107.0)]
    assert got[0]["other"] == 150.0 and got[0]["comm"] == 90.0
    with pytest.raises(ValueError):  # a step without its fault count is a bug, not a row
        rows([step(11.0)], [])


def affinity(*, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """Spawned: the cores this rank may run on, and those of a thread it starts (gloo's
    workers are started after the binding, as this one is)."""
    import threading

    seen: list[list[int]] = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    return {"cores": sorted(os.sched_getaffinity(0)), "thread": seen[0],
            "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            "mmap_max": os.environ.get("MALLOC_MMAP_MAX_")}  # fmt: skip


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_bind_cores_gives_each_rank_its_own_core() -> None:
    """``boost bench --bind-cores``: rank r on the r-th core, its threads with it; unbound,
    every core. ``--thp`` and ``--heap-reuse``: the environment the processes start with."""
    import argparse

    from boost_compiler.bench.harness import rank_cores

    cores = sorted(os.sched_getaffinity(0))
    res = spawn("tests.test_bench:affinity", 2, {}, timeout_s=120, tag="test", threads=1, bind=True)
    assert "error" not in res, res.get("traceback")
    got = [(r["cores"], r["thread"]) for r in res["per_rank"]]
    assert got == [([cores[0]], [cores[0]]), ([cores[1]], [cores[1]])]
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    env = bench.process_env(parser.parse_args([]))
    assert env == {**bench.THP, **bench.HEAP_REUSE}
    assert bench.process_env(parser.parse_args(["--no-thp", "--no-heap-reuse"])) == {}
    free = spawn("tests.test_bench:affinity", 2, {}, timeout_s=120, tag="test", threads=1,
                 env=env)  # fmt: skip
    assert [r["cores"] for r in free["per_rank"]] == [cores, cores]
    # the processes start with torch's huge-page switch and glibc's heap reuse; this one's
    # environment is as it was
    assert [(r["thp"], r["mmap_max"]) for r in free["per_rank"]] == [("1", "0")] * 2
    mine = (os.environ.get("THP_MEM_ALLOC_ENABLE"), os.environ.get("MALLOC_MMAP_MAX_"))
    assert [(r["thp"], r["mmap_max"]) for r in res["per_rank"]] == [mine] * 2
    with pytest.raises(ValueError, match="needs"):
        rank_cores(len(cores), 1)
