"""The prepared single-GPU run, for when a GPU machine is lent: one command, under 8 minutes.

    python benchmarks/gpu.py --out "$OUT"          # or: bash benchmarks/gpu.sh --out "$OUT"

1. Compiled training throughput of the ~1B CoLA-LLaMA preset (``boost_compiler.models.cola_llama``
   "1b": d=2048, d_ff=5472, r=512, 24 layers, 32 heads, vocab 32000; ~0.6B parameters, named
   after the dense model of its width) on one GPU, bf16 parameters, fused AdamW:
   ``torch.compile(model, backend="boost")`` vs ``backend="inductor"``; tokens/s and MFU
   (model FLOPs per token ``6 N + 12 L d s``, N = parameters without the embedding table, over
   the GPU's dense bf16 peak; PaLM's convention, no causal discount).
2. The GEMM microbench (``boost_compiler.bench.gemm``) at the paper's 7B shapes in bf16 (d=4096,
   d_ff=11008, r=1024, TP4, M = b*s = 4096): achieved TFLOP/s and % of peak per strategy, BTP's
   per-rank shapes against standard TP's (the BOOST reference: about 59% rising to 70-75%).
3. One layer of the preset under BTP (``btp``): parallelized at ``--btp-tp`` on torch's fake
   process group (this process plays rank 0; its collectives move nothing), so the rewritten
   graphs, online-norm kernels included, go through Inductor's CUDA lowering; one bf16
   training step of the layer timed against the same layer whole under Inductor: the
   per-rank compute share (ideal ``1/tp``), the collectives it would issue, and fallbacks.

4. Mixed precision (``mixed``): ``boost train --mixed-precision bf16`` on the GPU, as a user
   runs it (FSDP2's policy: fp32 master weights and moments, bf16 compute, fp32 reduction).
5. ``symm_mem_all_reduce`` (``symm``) at tp=2 on two GPUs, off against on, with the one-shot
   calls the profiler saw; skipped, with the reason, on a one-GPU machine.
   Parts 4 and 5 live in :mod:`benchmarks.gpu_dist`.

Without a CUDA GPU it exits at once with status 2 and says so; ``--dry-run`` instead runs every
part on the CPU at toy sizes (the tiny preset, a few steps), to show each can start before a
GPU is lent. A ``--budget-s`` guard skips what would not finish in time. Writes ``gpu.json``
and ``tables.txt`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

NO_GPU_EXIT = 2
ALL_PARTS = "btp,train,mixed,symm,gemm"
# dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name()
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def require_gpu() -> Any:
    """The CUDA device, or exit with a clear message (before anything slow happens)."""
    try:
        import torch
    except ImportError:
        print("benchmarks/gpu.py: torch is not installed in this Python", file=sys.stderr)
        raise SystemExit(NO_GPU_EXIT) from None
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"benchmarks/gpu.py: no CUDA GPU available (torch {torch.__version__}, {build}); "
            "this script is the prepared run for a GPU machine. On CPU use `boost bench`.",
            file=sys.stderr,
        )
        raise SystemExit(NO_GPU_EXIT)
    return torch.device("cuda", torch.cuda.current_device())


def _backend(name: str) -> Any:
    """``"boost"`` through its entry point when installed, else the backend function itself."""
    import torch

    if name == "boost" and "boost" not in torch._dynamo.list_backends():
        from boost_compiler import boost_backend

        return boost_backend  # a checkout run with PYTHONPATH=. (not pip-installed)
    return name


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(step: Any, device: Any, n: int, deadline: float) -> list[float]:
    """Seconds of up to ``n`` calls of ``step`` (CUDA events on a GPU, a clock elsewhere)."""
    import torch

    times = []
    for i in range(n):
        if time.perf_counter() > deadline:
            break
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
    if not times:
        raise TimeoutError("no timed step fitted in the time budget")
    return sorted(times)


def _reset_memory(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: Any) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def train(
    backend: str, args: argparse.Namespace, device: Any, peak: float | None, deadline: float
) -> dict[str, Any]:
    import torch

    from boost_compiler.models.cola_llama import build, example_inputs

    torch._dynamo.reset()
    _reset_memory(device)
    model = build(args.config, device=device, seed=0).to(torch.bfloat16)
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    n_flop = n_params - model.embed.weight.numel()
    flops_per_token = 6 * n_flop + 12 * cfg.n_layers * cfg.d_model * args.seq
    ids = [example_inputs(cfg, args.batch, args.seq, device=device, seed=i)[0] for i in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    run = torch.compile(model, backend=_backend(backend))
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        x = ids[i % 2]
        loss = run(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    t0 = time.perf_counter()
    step(0)  # compiles
    _sync(device)
    compile_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    _sync(device)
    times = _timed_steps(lambda i: step(args.warmup + i), device, args.steps, deadline)
    med = times[len(times) // 2]
    tokens = args.batch * args.seq
    return {
        "backend": backend,
        "params": n_params,
        "flops_per_token": flops_per_token,
        "compile_s": compile_s,
        "step_s": med,
        "steps": len(times),
        "tokens_per_s": tokens / med,
        "tflops": flops_per_token * tokens / med / 1e12,
        "mfu": flops_per_token * tokens / med / peak if peak else None,
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
        "max_memory_gib": _peak_memory_gib(device),
    }


def btp_layer(args: argparse.Namespace, device: Any, deadline: float) -> dict[str, Any]:
    """One layer of the preset, BTP at ``args.btp_tp`` on the fake process group, against the
    same layer whole: a bf16 training step each, compiled (Inductor lowers the rewritten
    graphs on ``device``). Per-rank compute share, planned collectives, fallbacks."""
    out: dict[str, Any] = {"tp": args.btp_tp}
    for name in ("whole", "btp"):
        out.update(_layer_steps(name, args, device, deadline))
    out["per_rank_share"] = out["btp_step_s"] / out["whole_step_s"]
    return out


def _layer_steps(name: str, args: argparse.Namespace, device: Any, deadline: float) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import boost_compiler
    from boost_compiler.models.cola_llama import build, example_inputs
    from boost_compiler.tp.collectives import fake_process_group

    torch._dynamo.reset()
    model = build(args.config, device=device, seed=0, n_layers=1).to(torch.bfloat16)
    (x,) = example_inputs(model.cfg, args.batch, args.seq, device=device, seed=0)
    out: dict[str, Any] = {}
    with fake_process_group(args.btp_tp) if name == "btp" else _nothing():
        if name == "btp":
            mesh = init_device_mesh(device.type, (args.btp_tp,))
            boost_compiler.parallelize(model, mesh, (x,), {"labels": x})
            plan = model.boost_plan
            out["fallbacks"] = list(plan.fallbacks)
            out["collectives"] = [f"{c.kind} {list(c.global_shape)}" for c in plan.collectives]
        run = torch.compile(model, backend=_backend("boost" if name == "btp" else "inductor"))

        def step(i: int) -> None:
            run(x, labels=x).backward()

        t0 = time.perf_counter()
        step(0)
        _sync(device)
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        times = _timed_steps(step, device, args.steps, deadline)
    out[f"{name}_step_s"] = times[len(times) // 2]
    return out


def _dist_part(part: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """:mod:`benchmarks.gpu_dist`'s ``part``, or the error that stopped it."""
    from benchmarks import gpu_dist

    try:
        if part == "mixed":
            return gpu_dist.mixed(args, deadline)
        sized = argparse.Namespace(**{**vars(args), "batch": args.symm_batch, "seq": args.symm_seq})
        return gpu_dist.symm(sized, deadline, args.dry_run)
    except Exception as exc:  # the other parts still run
        return {"error": f"{type(exc).__name__}: {exc}"}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--out", default=None, help="folder for gpu.json (default: bench-results/gpu-<time>)"
    )
    ap.add_argument(
        "--config",
        default="1b",
        help="CoLA-LLaMA preset to train (boost_compiler.models.cola_llama)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", default="boost,inductor")
    ap.add_argument("--parts", default=ALL_PARTS, help=f"of {ALL_PARTS}")
    ap.add_argument("--gemm-config", default="7b", help="boost_compiler.bench.gemm scale")
    ap.add_argument("--gemm-tp", type=int, default=4)
    ap.add_argument("--gemm-batch", type=int, default=1)
    ap.add_argument("--gemm-seq", type=int, default=4096)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (MFU)")
    ap.add_argument("--budget-s", type=float, default=450, help="skip what would run past this")
    ap.add_argument("--btp-tp", type=int, default=4, help="tp degree of the btp part")
    ap.add_argument("--symm-bytes", type=int, default=1 << 20,
                    help="symm part: all-reduces up to this many bytes go one-shot")  # fmt: skip
    ap.add_argument("--symm-batch", type=int, default=1, help="symm part: batch")
    ap.add_argument("--symm-seq", type=int, default=512, help="symm part: sequence length")
    ap.add_argument("--dry-run", action="store_true",
                    help="every part on the CPU at toy sizes: shows each can start (no GPU)")  # fmt: skip
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.dry_run:
        import torch

        device = torch.device("cpu")  # the dry run is the CPU's by definition
        args.config, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 64, 2, 1
        args.gemm_config, args.gemm_seq, args.btp_tp = "tiny", 32, 2
        args.symm_batch, args.symm_seq = 2, 64
        args.parts = ALL_PARTS
    else:
        device = require_gpu()  # fail fast, before the heavy imports

    import torch
    from rich.console import Console
    from rich.table import Table

    from boost_compiler.bench import gemm as gemm_mod

    console = Console(record=True, width=150)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAKS.items() if k in name), None
    )  # fmt: skip
    out_dir = Path(args.out or f"bench-results/gpu-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.__version__.startswith(("2.13", "2.14", "2.15")):
        console.print(
            f"[yellow]torch {torch.__version__}: boost-compiler is tested with 2.13-2.15[/]"
        )
    record: dict[str, Any] = {
        "device": name, "torch": torch.__version__, "peak_flops": peak, "args": vars(args),
        "train": {}, "gemm": [],
    }  # fmt: skip
    deadline = t_start + args.budget_s
    parts = args.parts.split(",")
    torch.backends.cuda.matmul.allow_tf32 = True
    if "btp" in parts:
        try:
            record["btp"] = btp_layer(args, device, deadline - 30)
        except Exception as exc:  # the other parts still run
            record["btp"] = {"error": f"{type(exc).__name__}: {exc}"}
        console.print(f"btp layer: {record['btp']}", markup=False)
    if "train" in parts:
        for backend in args.backends.split(","):
            if time.perf_counter() > deadline - 60:
                record["train"][backend] = {"error": "skipped: time budget"}
                continue
            try:
                record["train"][backend] = train(backend, args, device, peak, deadline - 30)
            except Exception as exc:  # the other backend and the GEMMs still run
                record["train"][backend] = {"error": f"{type(exc).__name__}: {exc}"}
            console.print(f"{backend}: {record['train'][backend]}", markup=False)
        t = Table(
            title=f"{args.config} CoLA-LLaMA, 1 GPU ({name}), bf16, b={args.batch}, "
            f"s={args.seq}, compiled training (fwd+bwd+fused AdamW)",
            title_justify="left",
        )
        for c in ("backend", "ms/step", "tokens/s", "TFLOP/s", "MFU", "compile s", "mem GiB"):
            t.add_column(c, justify="left" if c == "backend" else "right")
        for backend, r in record["train"].items():
            if "error" in r:
                t.add_row(backend, f"[red]{r['error'][:80]}[/]", *["-"] * 5)
                continue
            mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "-"
            mem = f"{r['max_memory_gib']:.1f}" if r["max_memory_gib"] is not None else "-"
            t.add_row(backend, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tflops']:.1f}", mfu, f"{r['compile_s']:.0f}", mem)  # fmt: skip
        console.print(t)
    for part in ("mixed", "symm"):
        if part in parts:
            record[part] = _dist_part(part, args, deadline - 30)
            console.print(f"{part}: {record[part]}", markup=False)
    if "gemm" in parts:
        if time.perf_counter() > deadline - 20:
            console.print("GEMM microbench skipped: time budget")
        else:
            record["gemm"] = gemm_mod.run(
                [args.gemm_config], tp=args.gemm_tp, dtype="bf16", device=str(device),
                batch=args.gemm_batch, seq=args.gemm_seq,
            )  # fmt: skip
            console.print(gemm_mod.table(record["gemm"], peak / 1e12 if peak else None))
    record["wall_s"] = time.perf_counter() - t_start
    (out_dir / "gpu.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    console.save_text(str(out_dir / "tables.txt"))
    console.print(f"wrote {out_dir / 'gpu.json'} in {record['wall_s']:.0f} s", markup=False)
    failed = [b for b, r in record["train"].items() if "error" in r]
    failed += [p for p in ("btp", "mixed", "symm") if "error" in record.get(p, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
