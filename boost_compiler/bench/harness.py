"""Shared helpers of the benchmarks: models, torch's DTensor TP plans, gloo event counting, spawning.

Used by ``boost bench`` (:mod:`.suite`) and ``benchmarks/comm_per_layer.py``.

Strategies (the tensor-parallel systems: :data:`STRATEGIES`, those of ``comm_per_layer.py``,
and :data:`NOSP`, which ``boost bench`` adds on request):

``boost``
    ``boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})`` on the CoLA-LLaMA of
    ``boost_compiler.models.cola_llama`` (bottleneck-aware TP); compiled with ``backend="boost"``.
``dtensor-lowrank``
    The same low-rank model with torch DTensor TP in the configuration torchtitan runs for
    LLaMA (:mod:`.peers` says where it was read): the "standard" plan of BOOST's paper inside
    the blocks (Megatron per factor pair, split along r: ``.down`` factors
    ``ColwiseParallel``, ``.up`` factors ``RowwiseParallel``) with sequence parallelism
    (norms ``SequenceParallel``, block inputs gathered by ``PrepareModuleInput``, o/down's up
    factors reduce-scattering into the sequence-sharded residual), a vocabulary-parallel
    embedding and head, and the loss under ``loss_parallel()``. Attention runs with all
    heads on every rank (the q/k/v up factors all-reduce): global ``n_heads``.
``dtensor-dense``
    A dense LLaMA of the same d/d_ff/heads (the CoLA model with every ``LowRankLinear``
    replaced by ``nn.Linear(d_in, d_out, bias=False)``) with torchtitan's plan itself:
    q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel(output_layouts=Shard(1))``,
    the same norms, embedding, head and loss; ``attn.n_heads``/``n_kv_heads`` local.
``dtensor-lowrank-nosp``, ``dtensor-dense-nosp``
    The previous baselines, kept as extra systems: the same Megatron plans inside the
    blocks only (o/down's outputs all-reduced), embedding, norms and LM head replicated,
    the full [b, s, V] logits and loss on every rank. On gloo, whose reduce-scatter is an
    all-reduce of the full input, sequence parallelism adds traffic (an all-reduce becomes
    an all-reduce plus an all-gather); these show what it costs there.

The torchtitan plans are the defaults: BOOST is compared with the configuration its peers
recommend and run, not with the one that happens to suit gloo. Their training step is
``with peers.loss_context(s): loss = peers.compute_loss(s, run, ids); loss.backward()``;
``model(ids, labels=ids)`` still works on them (it gathers the logits: exact, for
callers that compute the loss inside the model).

Counting: every profiler event whose name starts with ``gloo:`` / ``nccl:`` (the backend's
own events, one per collective that runs, whatever issued it: c10d, functional collectives,
DTensor redistribution, compiled graphs). ``input_shapes`` / ``input_dtypes`` record what
the rank contributes; "bytes" is the logical collective size (nccl-tests' convention, the
cost model's "payload"): the recorded input for all-reduce / broadcast / reduce-scatter /
all-to-all, times the group size for all-gather (= the gathered tensor).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..device import process_group_backend
from .peers import PROJS, TORCHTITAN

# comm_per_layer.py's list (its analytic table knows these names); parallelize also takes NOSP
STRATEGIES = ("boost", "boost-btp", *TORCHTITAN)
NOSP = ("dtensor-lowrank-nosp", "dtensor-dense-nosp")  # the previous DTensor baselines
# BOOST's planner on the dense twin (no bottleneck), measured against torchtitan's dense plan.
BOOST_DENSE = "boost-dense"
DENSE = ("dtensor-dense", "dtensor-dense-nosp", BOOST_DENSE)  # the strategies training the twin
# BTP alone: group_linears and online_norm off (what those two passes improve on).
BTP_ONLY = {"group_linears": False, "online_norm": False}
COMM_PREFIXES = ("gloo:", "nccl:")
BACKWARD_MARK = "bench::backward"

_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}


# --------------------------------------------------------------------------- models and plans


@dataclass(frozen=True)
class ModelSpec:
    """A CoLA-LLaMA size and the micro-batch it is run with (JSON-able)."""

    d: int = 256
    ff: int = 688
    rank: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None
    vocab: int = 256
    batch: int = 2
    seq: int = 64

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_model(strategy: str, spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The low-rank CoLA-LLaMA of ``spec`` (fp32, CPU), or its dense twin for :data:`DENSE`."""
    from ..models.cola_llama import LowRankLinear, build

    model = build(
        "tiny",
        seed=seed,
        vocab_size=spec.vocab,
        d_model=spec.d,
        d_ff=spec.ff,
        rank=spec.rank,
        n_heads=spec.heads,
        n_kv_heads=spec.kv_heads,
        n_layers=spec.layers,
        max_seq_len=max(256, spec.seq),
    )
    if strategy in DENSE:
        torch.manual_seed(seed + 1)
        for block in model.layers:
            for sub, names in PROJS.items():
                parent = getattr(block, sub)
                for name in names:
                    lr = getattr(parent, name)
                    assert isinstance(lr, LowRankLinear)
                    dense = nn.Linear(lr.down.in_features, lr.up.out_features, bias=False)
                    setattr(parent, name, dense)
    return model


def dtensor_plan(strategy: str, n_layers: int) -> dict[str, Any]:
    """The ``-nosp`` plans: Megatron on each factor pair (low-rank) or on the dense model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(n_layers):
        for sub, names in PROJS.items():
            for name in names:
                fqn = f"layers.{i}.{sub}.{name}"
                if strategy not in DENSE:
                    # Megatron on each factor pair: split r.
                    plan[f"{fqn}.down"] = ColwiseParallel()
                    plan[f"{fqn}.up"] = RowwiseParallel()
                elif name in ("o_proj", "down_proj"):
                    plan[fqn] = RowwiseParallel()
                else:
                    plan[fqn] = ColwiseParallel()
    return plan


def parallelize(
    strategy: str, model: nn.Module, mesh: Any, ids: torch.Tensor, world: int,
    options: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Shard ``model`` in place for ``strategy`` on the 1-D ``mesh`` (boost: ``options``)."""
    if strategy in ("boost", "boost-btp", BOOST_DENSE):
        import boost_compiler

        options = BTP_ONLY if strategy == "boost-btp" else options
        boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}, options=options)
        return
    if strategy in TORCHTITAN:
        from .peers import apply_tp

        apply_tp(model, mesh, lowrank=strategy not in DENSE, world=world)
        return
    if strategy not in NOSP:
        raise ValueError(
            f"unknown strategy {strategy!r}; choose from {(*STRATEGIES, *NOSP, BOOST_DENSE)}"
        )
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, dtensor_plan(strategy, len(model.layers)))
    if strategy in DENSE:
        for block in model.layers:  # heads are sharded: the views must use local counts
            attn = block.attn
            if attn.n_heads % world or attn.n_kv_heads % world:
                raise ValueError(
                    f"heads ({attn.n_heads}, {attn.n_kv_heads}) not divisible by {world}"
                )
            attn.n_heads //= world
            attn.n_kv_heads //= world


def scalar(t: torch.Tensor) -> float:
    """A loss as a float, whether a plain tensor or a DTensor."""
    t = t.detach()
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


# --------------------------------------------------------------------------- counting


def elem_bytes(dtype: str) -> int:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    try:  # e.g. "c10::Float8_e4m3fnuz"
        return getattr(torch, dtype.split("::")[-1].lower()).itemsize
    except AttributeError:
        print(
            f"warning: unknown dtype {dtype!r} in a collective event; assuming 4 bytes",
            file=sys.stderr,
        )
        return 4


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def count_collectives(prof: Any, world: int, backward_mark: str = BACKWARD_MARK) -> dict[str, Any]:
    """Collectives of one profiled step: count, logical bytes, by phase, op and shape.

    The forward/backward split classifies each event by its start time against the start
    of the ``record_function(backward_mark)`` range (none: everything is forward).
    """
    events = prof.events()
    bwd_start = min(
        (e.time_range.start for e in events if e.name == backward_mark), default=float("inf")
    )
    out: dict[str, Any] = {
        "count": 0,
        "bytes": 0,
        "contributed_bytes": 0,
        "fwd": {"count": 0, "bytes": 0},
        "bwd": {"count": 0, "bytes": 0},
        "by_op": {},
        "shapes": Counter(),
    }
    for e in events:
        if not e.name.startswith(COMM_PREFIXES):
            continue
        dtypes = list(e.input_dtypes or [])
        contributed = 0
        for i, shape in enumerate(e.input_shapes or []):
            if shape:
                contributed += _numel(shape) * elem_bytes(dtypes[i] if i < len(dtypes) else "float")
        logical = contributed * world if e.name.endswith(":all_gather") else contributed
        phase = "bwd" if e.time_range.start >= bwd_start else "fwd"
        out["count"] += 1
        out["bytes"] += logical
        out["contributed_bytes"] += contributed
        out[phase]["count"] += 1
        out[phase]["bytes"] += logical
        op = out["by_op"].setdefault(e.name, {"count": 0, "bytes": 0})
        op["count"] += 1
        op["bytes"] += logical
        shapes = "+".join(str(list(s)) for s in e.input_shapes or [])
        out["shapes"][f"{phase} {e.name} {shapes} {','.join(dtypes)}"] += 1
    out["shapes"] = dict(sorted(out["shapes"].items()))
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- spawning


def _entry(
    rank: int,
    world: int,
    target: str,
    payload: dict[str, Any],
    store: str,
    out_file: str,
    timeout_s: float,
    threads: int,
    log_file: str | None = None,
    bind: bool = False,
) -> None:
    """Child process: set threads, join the gloo group, run ``target``, write its JSON."""
    if bind:  # before any thread exists: OpenMP's pool and gloo's workers inherit the set
        os.sched_setaffinity(0, rank_cores(rank, threads))
    if log_file:  # the children's chatter (warnings, profiler lines) goes to a log, not the table
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(max(1, threads))
    module, _, attr = target.partition(":")
    result: dict[str, Any] = {"rank": rank}
    mesh = None
    try:
        if world > 1:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            # The mesh lives where the benchmark's modules are built: torch's default device
            # (the CPU unless the caller set another), not wherever an accelerator exists.
            device = torch.get_default_device()
            dist.init_process_group(
                process_group_backend(device),
                store=dist.FileStore(store, world),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
            mesh = init_device_mesh(device.type, (world,))
        fn: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), attr)
        result.update(fn(rank=rank, world=world, mesh=mesh, **payload))
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        raise
    finally:
        Path(out_file).write_text(json.dumps(result, default=str))
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, restored after: what spawned children inherit."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rank_cores(rank: int, threads: int) -> set[int]:
    """The cores rank ``rank`` is bound to: the ``threads`` after the lower ranks', from the
    cores this process may use (``torch.backends.xeon.run_cpu``'s layout, one instance per
    rank). Raises ValueError when the ranks need more cores than there are."""
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[rank * threads : (rank + 1) * threads]
    if len(mine) < threads:
        raise ValueError(
            f"binding rank {rank} to {threads} core(s) needs {(rank + 1) * threads}; "
            f"this process may use {len(cores)}"
        )
    return set(mine)


def spawn(
    target: str,
    world: int,
    payload: dict[str, Any],
    *,
    timeout_s: float = 600,
    threads: int | None = None,
    tag: str = "run",
    log_dir: str | Path | None = None,
    bind: bool = False,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``target`` (``"module:function"``) on ``world`` fresh processes; rank 0's result.

    Spawned processes with a ``FileStore`` instead of torchrun: no launcher, no TCP port to
    pick (other jobs may run on this machine), fresh dynamo/Inductor state for every system,
    a hard timeout, and results back as JSON files. ``threads`` per process default to the
    cores divided among the ranks. With ``log_dir``, each rank's stdout/stderr go to
    ``<log_dir>/<tag>.rank<r>.log``. ``bind``: rank ``r`` runs on its own ``threads`` cores
    (:func:`rank_cores`), its collectives' threads with it. ``env``: variables the
    processes start with (read by torch at its import, as ``THP_MEM_ALLOC_ENABLE``). A failure on any rank comes back as ``error`` /
    ``traceback`` / ``failed_rank``; ``per_rank`` holds every rank's result.
    """
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix=f"boost_bench_{tag}_") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        t0 = time.perf_counter()
        procs = [
            mp.get_context("spawn").Process(
                target=_entry,
                args=(
                    r,
                    world,
                    target,
                    payload,
                    store,
                    outs[r],
                    timeout_s,
                    threads,
                    str(Path(log_dir, f"{tag}.rank{r}.log")) if log_dir else None,
                    bind,
                ),  # fmt: skip
                daemon=False,
            )
            for r in range(world)
        ]
        with _environment(env or {}):
            for p in procs:
                p.start()
        error = _wait(procs, t0 + timeout_s, timeout_s)
        per_rank = []
        for r, f in enumerate(outs):
            if os.path.exists(f):
                per_rank.append(json.loads(Path(f).read_text()))
            else:
                per_rank.append(
                    {"rank": r, "error": error or f"rank {r} exited with {procs[r].exitcode}"}
                )
    res = dict(per_rank[0])
    failed = [r for r in per_rank if "error" in r]
    if failed:
        res["error"] = failed[0]["error"]
        res["traceback"] = failed[0].get("traceback", "")
        res["failed_rank"] = failed[0]["rank"]
    res["per_rank"] = per_rank
    res["wall_s"] = time.perf_counter() - t0
    return res


def _wait(procs: list[Any], deadline: float, timeout_s: float) -> str | None:
    """Join the ranks, all killed past the deadline or once one died; the timeout, or None."""
    error = None
    while any(p.is_alive() for p in procs):
        if time.perf_counter() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
            error = f"timed out after {timeout_s:.0f} s"
            break
        dead_bad = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
        if dead_bad:  # one rank died: the others would wait on a collective forever
            time.sleep(2)
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.join()
    return error
