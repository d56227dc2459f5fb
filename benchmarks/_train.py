"""One benchmarked training run (runs inside a spawned process; see ``_profile.spawn``).

A system is one of :data:`SYSTEMS`. Every system trains the same CoLA-LLaMA (same seed, same
batches, AdamW), except ``dtensor-dense`` which trains the dense twin; so the losses of the
low-rank systems must agree step by step, a check that each one computes the same model.

Timing: ``warmup`` steps (the first compiles), then ``steps`` timed steps. Each timed step
starts after a barrier (tensor-parallel systems) so the ranks start together; a step's time
is the slowest rank's ``forward + backward + optimizer`` wall time (CPU: synchronous). One
more step runs under ``torch.profiler`` to count the collectives (tensor-parallel systems).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks._profile import (
    BACKWARD_MARK,
    ModelSpec,
    count_collectives,
    make_model,
    parallelize,
    scalar,
)

TP_SYSTEMS = ("boost", "dtensor-lowrank", "dtensor-dense")
SINGLE_SYSTEMS = ("eager", "inductor")
SYSTEMS = TP_SYSTEMS + SINGLE_SYSTEMS
N_BATCHES = 4  # a small pool of fixed batches, cycled


def _profiled_step(run: Any, opt: Any, ids: torch.Tensor, world: int) -> dict[str, Any]:
    """One more step under torch.profiler: its collectives and where its time goes."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = run(ids, labels=ids)
        with record_function(BACKWARD_MARK):
            loss.backward()
        with record_function("bench::optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"comm": count_collectives(prof, world)}
    events = prof.events()
    span = [e for e in events if e.name.startswith(("bench::", "gloo:", "nccl:"))]
    out["marks_us"] = {e.name: e.cpu_time_total for e in span if e.name.startswith("bench::")}
    out["breakdown_ms"] = breakdown(prof.key_averages())
    # self CPU time by op (the profile of the step), heaviest first
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:25]
    out["top_self_cpu_us"] = [
        {"name": a.key, "calls": a.count, "self_us": a.self_cpu_time_total,
         "total_us": a.cpu_time_total}
        for a in top
    ]  # fmt: skip
    return out


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused AdamW, the same for every system (torchtitan's default; on CPU torch's own default
    would be the per-tensor for-loop). DTensor parameters and the plain ones (embedding, norms,
    LM head of the DTensor plans) go in two groups: one fused call cannot mix them."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=True)


CATEGORIES = (
    ("collectives", ("wait_tensor", "c10d::", "_c10d_functional::", "record_param_comms")),
    ("GEMM", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul")),
    ("attention", ("scaled_dot_product",)),
    ("optimizer", ("_fused_adamw", "_fused_adam", "Optimizer.")),
    ("Inductor kernels", ("## Call CompiledFxGraph",)),
)


def breakdown(averages: Any) -> dict[str, float]:
    """Self CPU time (ms) of one profiled step by category, from ``prof.key_averages()``.

    The backend's own ``gloo:*`` / ``nccl:*`` events run on its worker threads, overlapping
    the main thread's wait on them ("collectives" counts the issue and the wait): left out.
    "Inductor kernels": time inside a compiled graph not spent in an ATen op (its fused C++
    kernels); "other": everything else (Python, dispatch, DTensor, autograd, copies).
    """
    out = {name: 0.0 for name, _ in CATEGORIES}
    out["other"] = 0.0
    for a in averages:
        if a.key.startswith(("gloo:", "nccl:", "bench::")):
            continue
        cat = next((n for n, keys in CATEGORIES if any(k in a.key for k in keys)), "other")
        out[cat] += a.self_cpu_time_total / 1e3
    out["total"] = sum(out.values())
    return out


def _cache_counts(counters: Any) -> dict[str, int]:
    """Inductor FX-graph and AOTAutograd cache hits/misses/bypasses so far in this process."""
    return {
        k: v
        for group in ("inductor", "aot_autograd")
        for k, v in counters[group].items()
        if "cache" in k
    }


def _compile(system: str, model: torch.nn.Module) -> Any:
    if system == "boost":
        return torch.compile(model, backend="boost")  # the defaults: every boost pass
    if system == "eager":
        return model
    # torch's own stack: DTensor TP (or a single device) under the default Inductor backend.
    return torch.compile(model, backend="inductor")


def run_sizes(
    *,
    rank: int,
    world: int,
    mesh: Any,
    system: str,
    specs: dict[str, dict[str, Any]],
    steps: int,
    warmup: int,
    lr: float = 1e-3,
    profile: bool = True,
) -> dict[str, Any]:
    """:func:`run_system` for each size in turn, in one process group (a failure is kept)."""
    import traceback

    out: dict[str, Any] = {}
    for name, spec in specs.items():
        torch._dynamo.reset()
        try:
            out[name] = run_system(
                rank=rank, world=world, mesh=mesh, system=system, spec=spec, steps=steps,
                warmup=warmup, lr=lr, profile=profile,
            )  # fmt: skip
        except Exception as exc:  # the other sizes still run
            out[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    return {"sizes": out}


def run_system(
    *,
    rank: int,
    world: int,
    mesh: Any,
    system: str,
    spec: dict[str, Any],
    steps: int,
    warmup: int,
    lr: float = 1e-3,
    profile: bool = True,
) -> dict[str, Any]:
    """Build, parallelize, compile and time one system at one size (see the module docstring)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from examples.cola_llama import example_inputs

    cache_before = _cache_counts(counters)
    ms = ModelSpec(**spec)
    tp = system in TP_SYSTEMS
    torch.manual_seed(0)
    model = make_model(system if tp else "lowrank", ms)
    batches = [
        example_inputs(model.cfg, batch=ms.batch, seq=ms.seq, seed=i)[0] for i in range(N_BATCHES)
    ]
    out: dict[str, Any] = {
        "system": system,
        "world": world,
        "threads": torch.get_num_threads(),
        "params_global": sum(p.numel() for p in model.parameters()),
    }
    t0 = time.perf_counter()
    if tp:
        parallelize(system, model, mesh, batches[0], world)
    out["parallelize_s"] = time.perf_counter() - t0
    if system == "boost":
        from boost_compiler.costmodel import plan_comm

        pc = plan_comm(model.boost_plan)
        out["plan_comm"] = {
            "fwd_bytes": pc.forward_bytes,
            "bwd_bytes": pc.backward_bytes,
            "fwd_count": pc.forward_collectives,
            "bwd_count": pc.backward_collectives,
        }
    run = _compile(system, model)
    opt = make_optimizer(model, lr)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    losses: list[float] = []
    times: list[list[float]] = []  # per step: forward, backward, optimizer, total

    def step(i: int, record: bool = True) -> None:
        ids = batches[i % N_BATCHES]
        t_a = time.perf_counter()
        loss = run(ids, labels=ids)
        t_b = time.perf_counter()
        loss.backward()
        t_c = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_d = time.perf_counter()
        losses.append(scalar(loss))
        if record:
            times.append([t_b - t_a, t_c - t_b, t_d - t_c, t_d - t_a])

    t0 = time.perf_counter()
    barrier()
    step(0, record=False)  # compiles forward and backward
    out["first_step_s"] = time.perf_counter() - t0
    for i in range(1, warmup):
        barrier()
        step(i, record=False)
    for i in range(warmup, warmup + steps):
        barrier()
        step(i)
    t = torch.tensor(times, dtype=torch.float64)
    if world > 1:  # the step time is the slowest rank's
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        t = torch.stack(parts).amax(dim=0)
    out["step_times"] = t.tolist()
    if profile:
        out["profile"] = _profiled_step(run, opt, batches[(warmup + steps) % N_BATCHES], world)
    out["losses"] = losses
    out["cache"] = {
        k: v - cache_before.get(k, 0)
        for k, v in _cache_counts(counters).items()
        if v - cache_before.get(k, 0)
    }
    if "profile" in out and world > 1:
        out["comm"] = out["profile"].pop("comm")
    if system == "boost":
        out["boost_counters"] = dict(counters["boost"])
        out["fallbacks"] = list(model.boost_plan.fallbacks)
    return out
