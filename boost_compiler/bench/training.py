"""One benchmarked training run (runs inside a spawned process; see ``harness.spawn``).

A system is one of :data:`SYSTEMS`. Every system trains the same CoLA-LLaMA (same seed, same
batches, AdamW), except the ``dtensor-dense*`` ones which train the dense twin; so the losses
of the low-rank systems must agree step by step, a check that each one computes the same
model (loss_parallel computes the same loss). The torchtitan-plan systems compute their loss
outside the model, from the vocabulary-sharded logits, under ``loss_parallel()``
(:mod:`.peers`); the others through the model's ``labels=``.

Timing: the systems of one group (the tensor-parallel ones on the same ranks, or the
single-process ones) are set up side by side; each runs ``warmup`` steps (the first
compiles); then ``steps`` timed rounds run every system once, in rotating order, so a drift
in the machine's background load hits them all alike. Each timed step starts after a
barrier (tensor-parallel systems) so the ranks start together; a step's time is the slowest
rank's ``forward + backward + optimizer`` wall time (CPU: synchronous). One more step of
each system runs under ``torch.profiler`` with shapes and memory: its collectives, its
heaviest ops and its memory (:func:`memory_of_step`); then ``breakdown_steps`` more under a
light profiler split each rank's step into parts that add up to it (:mod:`.breakdown`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.profiler import record_function

from . import breakdown
from .breakdown import OPTIMIZER_MARK
from .harness import (
    BACKWARD_MARK,
    NOSP,
    ModelSpec,
    count_collectives,
    make_model,
    parallelize,
    scalar,
)
from .peers import TORCHTITAN, compile_blocks, compute_loss, loss_context

NOSP_SYSTEMS = NOSP  # extra systems, not in the defaults
# BOOST with a lowering lever switched the other way (not in the defaults), to measure each
# on and off side by side in one run: torch's blocking waits (collective_wait="block", which
# also turns the "auto" overlap off) instead of polled ones, and no overlap of communication
# with compute (overlap_comm=False)
BOOST_VARIANTS: dict[str, dict[str, Any]] = {
    "boost-block": {"collective_wait": "block"},
    "boost-no-overlap": {"overlap_comm": False},
    "boost-whole": {},
}
# Variants parallelized with other options: the whole model as one compiled graph.
BOOST_PARALLELIZE: dict[str, dict[str, Any]] = {"boost-whole": {"compile_blocks": False}}
TP_SYSTEMS = ("boost", *TORCHTITAN, *NOSP_SYSTEMS, *BOOST_VARIANTS)
BOOST_SYSTEMS = ("boost", *BOOST_VARIANTS)  # parallelized by boost_compiler
SINGLE_SYSTEMS = ("eager", "inductor")
SYSTEMS = TP_SYSTEMS + SINGLE_SYSTEMS
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in (*NOSP_SYSTEMS, *BOOST_VARIANTS))
N_BATCHES = 4  # a small pool of fixed batches, cycled


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def adamw_bytes(opt: torch.optim.Optimizer) -> int:
    """AdamW's state on this rank: exp_avg + exp_avg_sq (the 4-byte step counters left out)."""
    return local_bytes(
        v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")
    )


def _step_peak_bytes(prof: Any) -> int | None:
    """Peak of the bytes allocated during the profiled window over those live at its start.

    From the profiler's allocation records (``profile_memory=True``): every CPU allocation
    and free through c10's allocator, in time order. ``prof.events()`` only keeps those
    outside any op, so the raw records are read from the kineto results.
    """
    try:
        records = prof.profiler.kineto_results.events()
    except AttributeError:  # another torch: the private attribute moved
        return None
    running = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in records if e.name() == "[memory]"):
        running += nbytes
        peak = max(peak, running)
    return peak


def memory_of_step(params: int, adamw: int, grads: int, step_peak: int | None) -> dict[str, Any]:
    """One rank's memory: its state bytes and the step's peak of tensor memory.

    ``peak_bytes`` = what is live when the step starts (parameters and AdamW state; the
    gradients are None, zero_grad(set_to_none=True)) + the profiler's peak of allocations
    during forward, backward and AdamW (activations, gradients, temporaries). Tensors the
    step does not own (the batches, RoPE tables, compiled graphs' constants) are left out.
    This bench runs on CPU; on a GPU the counterpart would be torch.cuda.max_memory_allocated.
    """
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "adamw_bytes": adamw,
        "state_bytes": params + grads + adamw,
        "step_peak_bytes": step_peak,
        "peak_bytes": None if step_peak is None else params + adamw + step_peak,
    }


def _profiled_step(
    system: str, run: Any, model: torch.nn.Module, opt: Any, ids: torch.Tensor, world: int
) -> dict[str, Any]:
    """One more step under torch.profiler: its collectives, where its time goes, its memory."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    params, adamw = local_bytes(model.parameters()), adamw_bytes(opt)
    cpu = [ProfilerActivity.CPU]
    with profile(activities=cpu, record_shapes=True, profile_memory=True) as prof:
        with loss_context(system):
            loss = compute_loss(system, run, ids)
            with record_function(BACKWARD_MARK):
                loss.backward()
        # read between backward and the optimizer: the only moment the gradients exist
        grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        with record_function("bench::optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"comm": count_collectives(prof, world)}
    out["memory"] = memory_of_step(params, adamw, grads, _step_peak_bytes(prof))
    events = prof.events()
    span = [e for e in events if e.name.startswith(("bench::", "gloo:", "nccl:"))]
    out["marks_us"] = {e.name: e.cpu_time_total for e in span if e.name.startswith("bench::")}
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
    LM head of the ``-nosp`` plans) go in two groups: one fused call cannot mix them."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=True)


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
    if system in BOOST_VARIANTS:
        return torch.compile(model, backend="boost", options=BOOST_VARIANTS[system])
    if system == "eager":
        return model
    if system in TORCHTITAN:  # torchtitan's apply_compile: per block, the rest eager
        compile_blocks(model)
        return model
    # torch's own stack: DTensor TP (or a single device) under the default Inductor backend.
    return torch.compile(model, backend="inductor")


def run_group(
    *,
    rank: int,
    world: int,
    mesh: Any,
    systems: list[str],
    specs: dict[str, dict[str, Any]],
    steps: int,
    warmup: int,
    lr: float = 1e-3,
    profile: bool = True,
    breakdown_steps: int = 3,
) -> dict[str, Any]:
    """Every size in turn; at each, ``systems`` set up side by side and timed interleaved.

    Returns ``{"sizes": {size: {system: result}}}``; a system that fails at a size is kept
    as ``{"error": ..., "traceback": ...}`` and the others go on.
    """
    import resource

    out: dict[str, Any] = {}
    for name, spec in specs.items():
        torch._dynamo.reset()
        # compiled here (the warm-up): each Inductor kernel an event of the breakdown's kinds
        with breakdown.kernel_events():
            out[name] = _time_interleaved(systems, ModelSpec(**spec), world, mesh, steps,
                                          warmup, lr)  # fmt: skip
        for system, sysrun in list(out[name].items()):
            if isinstance(sysrun, _System):
                out[name][system] = sysrun.finish(profile, breakdown_steps)
                # the process's RSS high-water mark so far (Linux: KiB), every system and
                # size of this group included: context for the JSON, not a per-system figure
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                out[name][system]["rss_hwm_bytes"] = rss
    return {"sizes": out}


class _System:
    """One system at one size: its model, compiled callable, optimizer and measurements."""

    def __init__(
        self, system: str, ms: ModelSpec, world: int, mesh: Any, lr: float, batches: list[Any]
    ) -> None:
        tp = system in TP_SYSTEMS
        self.system, self.world, self.batches = system, world, batches
        torch.manual_seed(0)
        self.model = make_model(system if tp else "lowrank", ms)
        self.out: dict[str, Any] = {
            "system": system,
            "world": world,
            "threads": torch.get_num_threads(),
            "params_global": sum(p.numel() for p in self.model.parameters()),
        }
        t0 = time.perf_counter()
        boost = system in BOOST_SYSTEMS
        if tp:
            parallelize("boost" if boost else system, self.model, mesh, batches[0], world,
                        BOOST_PARALLELIZE.get(system))  # fmt: skip
        self.out["parallelize_s"] = time.perf_counter() - t0
        if boost:
            from boost_compiler.costmodel import plan_comm

            pc = plan_comm(self.model.boost_plan)
            self.out["plan_comm"] = {
                "fwd_bytes": pc.forward_bytes,
                "bwd_bytes": pc.backward_bytes,
                "fwd_count": pc.forward_collectives,
                "bwd_count": pc.backward_collectives,
            }
        self.run = _compile(system, self.model)
        self.opt = make_optimizer(self.model, lr)
        self.losses: list[float] = []
        self.times: list[list[float]] = []  # per step: forward, backward, optimizer, total

    def step(self, i: int, record: bool = True) -> None:
        ids = self.batches[i % N_BATCHES]
        t_a = time.perf_counter()
        with loss_context(self.system):  # loss_parallel covers forward and backward
            loss = compute_loss(self.system, self.run, ids)
            t_b = time.perf_counter()
            loss.backward()
        t_c = time.perf_counter()
        with record_function(OPTIMIZER_MARK):  # the breakdown's optimizer part
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        t_d = time.perf_counter()
        self.losses.append(scalar(loss))
        if record:
            self.times.append([t_b - t_a, t_c - t_b, t_d - t_c, t_d - t_a])

    def _breakdown(self, n: int, timed_step_s: float) -> dict[str, Any]:
        """This rank's step split into parts (:mod:`.breakdown`), from ``n`` profiled steps."""

        def run_step(i: int) -> None:
            self.step(i, record=False)

        def barrier() -> None:  # each step's range opens with the ranks together
            if self.world > 1:
                import torch.distributed as dist

                dist.barrier()

        steps = breakdown.profile_steps(run_step, len(self.losses), n, before=barrier)
        device = next(self.model.parameters()).device.type
        return breakdown.median_step(steps, timed_step_s, device)

    def finish(self, profile: bool, breakdown_steps: int = 0) -> dict[str, Any]:
        out = self.out
        t = torch.tensor(self.times, dtype=torch.float64)
        if self.world > 1:  # the step time is the slowest rank's
            import torch.distributed as dist

            parts = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(parts, t)
            t = torch.stack(parts).amax(dim=0)
        out["step_times"] = t.tolist()
        if breakdown_steps:
            timed = statistics.median(t[:, 3].tolist())  # as analysis.py reports it
            out["breakdown"] = self._breakdown(breakdown_steps, timed)
        if profile:
            ids = self.batches[len(self.losses) % N_BATCHES]
            prof = _profiled_step(self.system, self.run, self.model, self.opt, ids, self.world)
            out["profile"] = prof
            out["memory"] = prof.pop("memory")
            if self.world > 1:
                import torch.distributed as dist

                out["comm"] = prof.pop("comm")
                ranks: list[Any] = [None] * self.world
                dist.all_gather_object(ranks, out["memory"])
                out["memory_ranks"] = ranks
        out["losses"] = self.losses
        if self.system in BOOST_SYSTEMS:
            out["fallbacks"] = list(self.model.boost_plan.fallbacks)
        return out


def _time_interleaved(
    systems: list[str], ms: ModelSpec, world: int, mesh: Any, steps: int, warmup: int, lr: float
) -> dict[str, Any]:
    """Set up each system, warm each up, then time them in turns (A B C, B C A, ...).

    Interleaving puts every system under the same background load: on a shared machine the
    load drifts over minutes, and timing the systems one after the other would compare the
    load of one minute with the load of the next.
    """
    import traceback

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from ..models.cola_llama import example_inputs

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    cfg_model = make_model("lowrank", ms)
    batches = [
        example_inputs(cfg_model.cfg, batch=ms.batch, seq=ms.seq, seed=i)[0]
        for i in range(N_BATCHES)
    ]
    del cfg_model
    live: dict[str, _System] = {}
    res: dict[str, Any] = {}
    for system in systems:
        try:
            before, boost_before = _cache_counts(counters), dict(counters["boost"])
            sysrun = _System(system, ms, world, mesh, lr, batches)
            t0 = time.perf_counter()
            barrier()
            sysrun.step(0, record=False)  # compiles forward and backward
            sysrun.out["first_step_s"] = time.perf_counter() - t0
            for i in range(1, warmup):
                barrier()
                sysrun.step(i, record=False)
            sysrun.out["cache"] = {
                k: v - before.get(k, 0)
                for k, v in _cache_counts(counters).items()
                if v - before.get(k, 0)
            }
            if system in BOOST_SYSTEMS:
                sysrun.out["boost_counters"] = {
                    k: v - boost_before.get(k, 0) for k, v in counters["boost"].items()
                }
            live[system] = sysrun
            res[system] = sysrun
        except Exception as exc:  # the other systems still run
            res[system] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    names = list(live)
    for i in range(steps):
        for j in range(len(names)):
            system = names[(i + j) % len(names)]
            barrier()
            live[system].step(warmup + i)
    return res
