"""Where a training step's time goes, per rank: parts that add up to the step.

A few steps run under ``torch.profiler`` (CPU activity only: no shapes, stacks or memory,
so the profiled step stays within a few percent of the timed ones). Each step is the
``bench::step`` range on the rank's main thread; every profiler event on that thread inside
it contributes its *self* time (its own time, children excluded) to one part:

``GEMM``           ``aten::mm`` / ``bmm`` / ``addmm`` / ``baddbmm`` / ``_grouped_mm``.
``other compute``  every other ATen op, attention included, and the fused C++ kernels of
                   compiled graphs (``## Call CompiledFxGraph``'s self time: they run
                   inside it and record no event of their own).
``exposed comm``   the time the main thread spends inside collectives: issuing them and
                   waiting in ``wait_tensor`` / ``c10d::*`` / ``boost::collective_wait``. The backend's own work on its
                   worker threads (gloo's ``gloo:*`` events) is not on this thread: what is
                   counted is only what the step could not overlap. Compiled graphs and
                   DTensor issue functional collectives, whose wait is an op
                   (``wait_tensor``); an eager ``dist.all_reduce``'s ``Work.wait()`` is not
                   one and would land in overhead.
``optimizer``      the whole ``bench::optimizer`` range (``opt.step`` + ``zero_grad``).
``overhead``       the rest of the step: Python, dynamo's guards, dispatch, autograd's
                   engine, DTensor's sharding propagation, the wrappers' own time.

Every part is the main CPU thread's time. On a CPU run that is where the kernels run; on
an accelerator it is only their launches (and the waits), so the parts say where the host's
time goes, not the device's: each step records its ``device`` and ``clock`` ("host"), and
the report's table says so in its title and, for a step that ran elsewhere than the CPU,
in red (:func:`clock_note`).

Overhead is the remainder, so the parts of a profiled step sum to its wall time exactly;
what can disagree is the profiled step and the timed ones (profiler cost), reported as
``profiled_vs_timed``. The step whose wall time is the median of the profiled ones is kept.

Each step is also split by kind of work (``kinds``: the loss, the embedding, the norms,
attention, activations, copies, other), so that a rank's "other compute" can be set against
one process's kind by kind (issue 45). Inductor's compiled graphs run their fused kernels
inside one ``## Call CompiledFxGraph`` event; with :func:`kernel_events` on (Inductor's
``cpp.enable_kernel_profile``, set before the compile) each C++ kernel records an event
named after the ATen ops it fuses (``cpp_fused__log_softmax_amax_exp_sub_sum_3``), and its
kind is read from that name, first match in :data:`KINDS`' order: a heuristic, so the table
says "by kernel name", and what matches nothing is "other", not guessed. ``top`` keeps the
step's heaviest op and kernel names with their self time, to tell which kernel a kind is.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

PARTS = ("GEMM", "other compute", "exposed comm", "optimizer", "overhead")
STEP_MARK = "bench::step"
OPTIMIZER_MARK = "bench::optimizer"
GEMM_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm"})
COMM_PREFIXES = ("_c10d_functional::", "c10d::", "c10d_functional::", "record_param_comms")
COMM_NAMES = frozenset({
    "_c10d_functional::wait_tensor", "aten::wait_tensor",
    # boost's own start/wait pairs (boost_compiler/lowering/poll_waits.py) and the pipeline
    # stages' sharded boundary (an all-gather: boost_compiler/tp/shard_boundary.py)
    "boost::all_reduce_start_", "boost::all_gather_start", "boost::collective_wait",
    "boost::collective_wait_", "boost::scatter_wait",
    "boost::from_tp_shards",
})  # fmt: skip
# compiled graphs: their fused kernels run inside this event and record none of their own
INDUCTOR_CALL = "## Call CompiledFxGraph"


def classify(name: str) -> str:
    """The part an event's self time belongs to (outside the optimizer range)."""
    if name in GEMM_OPS:
        return "GEMM"
    if name in COMM_NAMES or name.startswith(COMM_PREFIXES):
        return "exposed comm"
    if name.startswith(("aten::", INDUCTOR_CALL)) or is_kernel(name):
        return "other compute"
    return "overhead"


def split_step(step: Any, events: list[Any]) -> dict[str, float]:
    """One ``bench::step`` event's wall time (ms) split into :data:`PARTS`.

    ``events``: the profiler's events on the step's thread inside its range. Events under
    ``bench::optimizer`` count as the optimizer's whole range, not individually.
    """
    start, end = step.time_range.start, step.time_range.end
    parts = dict.fromkeys(PARTS, 0.0)
    parts["optimizer"], outside = _optimizer_ms(step, events)
    for e in outside:
        part = classify(e.name)
        if part != "overhead":
            parts[part] += e.self_cpu_time_total / 1e3
    wall = (end - start) / 1e3
    parts["overhead"] = wall - sum(v for k, v in parts.items() if k != "overhead")
    return {"wall_ms": wall, **parts}


def _optimizer_ms(step: Any, events: list[Any]) -> tuple[float, list[Any]]:
    """The ``bench::optimizer`` ranges' time (ms), and the step's other events (the marks
    and everything inside an optimizer range left out)."""
    opt = [(e.time_range.start, e.time_range.end) for e in events if e.name == OPTIMIZER_MARK]
    outside = [
        e for e in events
        if e is not step and e.name not in (STEP_MARK, OPTIMIZER_MARK)
        and not any(s <= e.time_range.start and e.time_range.end <= t for s, t in opt)
    ]  # fmt: skip
    return sum(t - s for s, t in opt) / 1e3, outside


def steps_of(prof: Any) -> list[dict[str, float]]:
    """Every ``bench::step`` of a finished profile, split (in the order they ran)."""
    events = list(prof.events())
    out = []
    for step in (e for e in events if e.name == STEP_MARK):
        inside = [
            e for e in events
            if e.thread == step.thread
            and step.time_range.start <= e.time_range.start
            and e.time_range.end <= step.time_range.end
        ]  # fmt: skip
        parts = split_step(step, inside)
        out.append({**parts, "kinds": split_kinds(step, inside), "top": heaviest(step, inside)})
    return out


def profile_steps(
    run_step: Callable[[int], None], first: int, n: int, before: Callable[[], None] | None = None
) -> list[dict[str, float]]:
    """Run ``run_step(first + i)`` for ``i < n`` under the profiler, each in a step range.

    ``run_step`` opens ``bench::optimizer`` around its optimizer call; ``before`` (a
    barrier of the ranks) runs before each step's range opens, outside it.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(n):
            if before is not None:
                before()
            with record_function(STEP_MARK):
                run_step(first + i)
    return steps_of(prof)


def median_step(
    steps: list[dict[str, float]], timed_step_s: float, device: str | None = None
) -> dict[str, Any]:
    """The profiled step of median wall time, beside the timed median (``timed_ms``);
    ``device``: the type of the device the step's tensors were on."""
    ordered = sorted(steps, key=lambda s: s["wall_ms"])
    mid: dict[str, Any] = dict(ordered[(len(ordered) - 1) // 2])
    mid["clock"], mid["device"] = "host", device
    timed = timed_step_s * 1e3
    mid["timed_ms"] = timed
    mid["profiled_vs_timed"] = mid["wall_ms"] / timed if timed else None
    mid["profiled_steps"] = len(steps)
    mid["profiled_wall_ms"] = [s["wall_ms"] for s in steps]
    return mid


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' breakdowns side by side, with each part's slowest rank."""
    worst = {p: max(r[p] for r in ranks) for p in (*PARTS, "wall_ms")}
    return {"ranks": ranks, "max": worst, "spread_ms": _spread(ranks)}


def _spread(ranks: list[dict[str, Any]]) -> float:
    walls = [r["wall_ms"] for r in ranks]
    return max(walls) - min(walls) if walls else 0.0


def clock_note(ranks: list[dict[str, Any]]) -> str | None:
    """What a table of these breakdowns must say: None where every step ran on the CPU
    (the host's time is the compute's), else that the parts are host time only."""
    elsewhere = sorted({r.get("device") or "an unrecorded device" for r in ranks} - {"cpu"})
    if not elsewhere:
        return None
    return (
        f"CPU-only clock: these steps ran on {', '.join(elsewhere)}, where the parts are the "
        "host thread's time (kernel launches, waits), not the device's kernel time"
    )


def within(parts: dict[str, Any], tolerance: float = 0.05) -> bool:
    """Do the parts of a profiled step account for the timed step within ``tolerance``?"""
    total = sum(parts[p] for p in PARTS)
    timed = parts.get("timed_ms") or 0.0
    return bool(timed) and abs(total - timed) <= tolerance * timed


# --- the same step by kind of work (issue 45): the loss, the norms, attention, ... --------
# kind -> op names, matched as whole words of an event's name (``cat`` is not ``scatter``);
# first match wins: attention first, copies (casts appear in many fusions) and the
# embedding last: a kernel of a compiled region (``invoke_subgraph``, per-block compile)
# carries the op that feeds the region in its name, the embedding lookup for the first
# block, so every kernel of the block reads "embedding". A decomposed softmax's
# ``amax``/``exp`` name no kind: attention's and the loss's look alike.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("scaled_dot_product", "flash_attention", "sdpa")),
    ("loss", ("log_softmax", "logsumexp", "nll_loss", "cross_entropy")),
    ("norm", ("rsqrt", "layer_norm", "rms_norm")),
    ("activation", ("silu", "gelu", "sigmoid", "relu", "tanh")),
    ("copies", ("clone", "copy", "cat", "slice_scatter", "contiguous", "index_put")),
    ("embedding", ("embedding",)),
)
_WORDS = tuple(
    (kind, re.compile("|".join(rf"(?:^|[_:]){w}(?=$|[_\d])" for w in words)))
    for kind, words in KINDS
)
FINE = ("GEMM", *(k for k, _ in KINDS), "other", "comm", "optimizer")
TOP_EVENTS = 15  # names kept per profiled step (``top``)
# Inductor's kernel events: ``graph_0_cpp_fused_add_mean_mul_pow_rsqrt_1`` (C++, per graph)
KERNEL_NAME = re.compile(r"^(graph_\d+_)?(cpp_|triton_)")


def is_kernel(name: str) -> bool:
    """An Inductor kernel's own event (recorded with :func:`kernel_events` on)."""
    return KERNEL_NAME.match(name) is not None


def kind_of(name: str) -> str | None:
    """The kind of an event's work, or None for what is no compute (Python, dispatch):
    :func:`classify`'s part, its other compute split by the names in :data:`KINDS`."""
    part = classify(name)
    if part != "other compute":
        return {"GEMM": "GEMM", "exposed comm": "comm"}.get(part)
    if name.startswith(INDUCTOR_CALL):
        return "other"  # the compiled graph's own time around its kernels
    low = name.lower()
    return next((kind for kind, words in _WORDS if words.search(low)), "other")


def split_kinds(step: Any, events: list[Any]) -> dict[str, float]:
    """Self time (ms) by kind of the events inside one profiled step; the optimizer's range
    counted whole, as :func:`split_step` counts it."""
    out = dict.fromkeys(FINE, 0.0)
    out["optimizer"], outside = _optimizer_ms(step, events)
    for e in outside:
        kind = kind_of(e.name)
        if kind is not None:
            out[kind] += e.self_cpu_time_total / 1e3
    return out


def heaviest(step: Any, events: list[Any], n: int = TOP_EVENTS) -> dict[str, float]:
    """The ``n`` op and kernel names of most self time (ms) in one profiled step, outside the
    optimizer, heaviest first: which kernel a kind's time is (a rank's loss kernel against
    one process's), read off the same step as the parts, not off a separate profile."""
    _, outside = _optimizer_ms(step, events)
    by_name: dict[str, float] = {}
    for e in outside:
        if kind_of(e.name) is not None:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:n])


@contextlib.contextmanager
def kernel_events() -> Iterator[None]:
    """Inductor's C++ kernels each record a profiler event (compiled inside this context).

    The cost when no profiler runs is one check per kernel call; the compiled code keeps it.
    """
    import torch._inductor.config as inductor

    before = inductor.cpp.enable_kernel_profile
    inductor.cpp.enable_kernel_profile = True
    try:
        yield
    finally:
        inductor.cpp.enable_kernel_profile = before


def ratio_rows(one: dict[str, float], ranks: list[dict[str, float]]) -> list[tuple[str, ...]]:
    """``(kind, one process, rank 0, ..., slowest rank / one process)`` per kind, as text."""
    rows = []
    for kind in FINE:
        base, mine = one.get(kind, 0.0), [r.get(kind, 0.0) for r in ranks]
        ratio = f"{max(mine) / base:.2f}" if base > 0.05 else "-"
        rows.append((kind, f"{base:.1f}", *(f"{m:.1f}" for m in mine), ratio))
    return rows


__all__ = [
    "FINE", "KINDS", "PARTS", "classify", "clock_note", "is_kernel", "kernel_events", "kind_of",
    "heaviest", "median_step", "profile_steps", "ratio_rows", "split_kinds", "split_step", "steps_of",
    "summarise", "within",
]  # fmt: skip
