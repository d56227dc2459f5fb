"""The training loop: CoLA-LLaMA pre-training, BTP inside ``tp``, FSDP2 across ``dp``.

Layout: a 2-D ``DeviceMesh`` ``(dp, tp)``. Every rank builds the same model
(same seed); ``parallelize(model, mesh["tp"])`` turns its parameters into plain
local TP blocks; ``fully_shard(model, mesh=mesh["dp"])`` then shards those blocks
over dp. Why this order works: the parallelized forward looks each parameter up on
its owning module at every call (``parallel.shadow.current_local``), and FSDP2's root
pre-forward hook puts the all-gathered (unsharded) block there; its post-backward
reduce-scatters (averages) the gradients over dp. At tp > 1 only the root module is
wrapped: the forward runs a shadow copy of the module tree, so hooks on inner modules
would never fire; at tp = 1 each decoder block is wrapped, then the root (``fsdp.py``).
``--no-fsdp`` replaces FSDP2 by a plain gradient all-reduce over dp;
``--mixed-precision bf16`` is FSDP2's ``MixedPrecisionPolicy`` (``fsdp.py``).

The same global batch is split over dp (disjoint rows), identical within a tp
group, so the loss of step N is the same number at every (dp, tp) layout up to
float rounding: that is what the parity tests check.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._logging import get_logger
from ..device import process_group_backend
from ..parallel.agreement import agree
from . import checkpoint as ckpt
from . import comm, divergence, mfu, report, run_folder
from .clip import clip_grad_norm_
from .config import TrainConfig, TrainConfigError
from .data import check_paths as check_data_paths
from .evaluate import validate
from .families import spec_for
from .report import Metrics, default_plot, plot_losses, progress_bar, read_metrics
from .setup import Run, setup

log = get_logger(__name__)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine to ``lr * min_lr_ratio``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def init_distributed(timeout_s: float | None = None) -> bool:
    """Join torchrun's group (env://), or make a 1-rank group; True if this call created it.

    ``timeout_s`` (``--comm-timeout``) bounds every collective's wait on the group.
    """
    if dist.is_initialized():
        return False
    cuda = torch.cuda.is_available()
    backend = process_group_backend()
    timeout = comm.timeout_of(timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:  # one process: a private in-memory store, no launcher, no port
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return True


@dataclass
class TrainResult:
    """What a run returns on every rank (losses: rank 0's view, the dp-averaged loss)."""

    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)  # every rank's, by step
    start_step: int = 0
    final_step: int = 0
    model: nn.Module | None = None
    checkpoint: Path | None = None
    plot: Path | None = None
    tokens_per_s: float = 0.0


def _all_reduce_grads(run: Run) -> None:
    """``--no-fsdp``: average the gradients over dp (one flat buffer)."""
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=run.mesh["dp"].get_group())
    flat /= run.dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step(run: Run, step: int) -> tuple[float, float]:
    """One optimizer step on batch ``step``; returns (dp-mean loss, grad norm before clip).

    A non-finite loss or norm takes no step: the gradients are dropped, the parameters
    stay as they were, and the caller stops or skips (``--on-nonfinite``). Every rank sees
    the same two numbers (the norm is global, the loss the dp mean, broadcast over pp),
    so every rank decides alike.
    """
    cfg = run.cfg
    lr = lr_at(step, cfg)
    for group in run.opt.param_groups:
        group["lr"] = lr
    ids = run.batch(step)
    if run.pipe is not None:
        loss = run.pipe.step(ids)
    else:
        loss = run.forward(ids, labels=ids)
        loss.backward()
    if run.dp > 1 and not run.fsdp:
        _all_reduce_grads(run)
    norm = clip_grad_norm_(
        run.slots, cfg.clip,
        tp_group=run.mesh["tp"].get_group() if run.tp > 1 else None,
        dp_group=run.norm_group if run.pipe is not None else
        (run.mesh["dp"].get_group() if run.fsdp else None),
    )  # fmt: skip
    value = loss.detach().float().reshape(1)
    if run.dp > 1:
        dist.all_reduce(value, group=run.mesh["dp"].get_group())
        value /= run.dp
    mean, total = value.item(), norm.item()
    if math.isfinite(mean) and math.isfinite(total):
        run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return mean, total


def _train_state(run: Run, step: int) -> dict[str, Any]:
    cfg = run.cfg
    return {
        "step": step,
        "tokens_seen": step * cfg.batch * cfg.seq,
        "data": {"next_step": step, "source": run.corpus.source, "digest": run.corpus.digest,
                 "seed": cfg.seed, "batch": cfg.batch, "seq": cfg.seq, **run.corpus.state()},
        "layout": {"pp": cfg.pp, "dp": run.dp, "tp": run.tp, "fsdp": run.fsdp},
        "config": cfg.to_json(),
        # What an export needs besides the weights (a transformers model's config.json).
        **spec_for(cfg).state_record(run.model),
    }  # fmt: skip


# What decides the learning rate at a step: a resume must not change it silently.
SCHEDULE = ("steps", "lr", "warmup", "min_lr_ratio")


def _check_resume(run: Run, state: dict[str, Any]) -> None:
    data, cfg = state.get("data", {}), run.cfg
    saved = state.get("config", {})
    changed = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (saved: {saved[k]})"
               for k in SCHEDULE if k in saved and saved[k] != getattr(cfg, k)]  # fmt: skip
    if changed and not cfg.allow_schedule_change:
        raise TrainConfigError(
            f"--resume would change the learning-rate schedule: {', '.join(changed)}; pass "
            "the saved values, or --allow-schedule-change to continue on the new schedule"
        )
    if changed:
        log.warning("resuming on a changed schedule: %s", ", ".join(changed))
    if data.get("digest") != run.corpus.digest:
        log.warning("resuming on another corpus (%s) than the checkpoint's", run.corpus.source)
    for key in ("seed", "batch", "seq"):
        if data.get(key) != getattr(cfg, key):
            log.warning("resuming with %s=%s, the checkpoint used %s", key, getattr(cfg, key),
                        data.get(key))  # fmt: skip


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or continue, with ``cfg.resume``) a training run; a collective over the world."""
    created = init_distributed(cfg.comm_timeout)
    watch = comm.watch_launcher()  # a rank whose torchrun died stops (train/comm.py)
    try:
        # A collective that fails because a peer died names that rank (train/comm.py).
        with comm.lost_rank_errors(cfg.comm_timeout):
            board = _check_flags(cfg)
            claim = _claim_run_folder(cfg)
            try:
                return _train(cfg, claim, board, watch)
            finally:
                if claim.lock is not None:
                    claim.lock.release()
    finally:
        if watch is not None:
            watch.stop()
        if created:
            dist.destroy_process_group()


def _check_flags(cfg: TrainConfig) -> report.TensorBoard | None:
    """What the flags alone decide, before any file is made (setup validates again):
    a bad value, a missing package or data file stops every rank with nothing written.

    Checked on every rank and agreed in one collective: a rank whose host lacks the data
    (another node's disk) raises its error, every other rank a ``PeerRankError`` naming
    it, instead of waiting for it in the run folder's broadcast until the timeout.
    """
    try:
        cfg.validate(dist.get_world_size())
        spec_for(cfg).check(cfg)
        check_data_paths(cfg)
        mine: dict[str, Any] | BaseException = {}
    except Exception as exc:
        mine = exc
    agree(dist.group.WORLD, "boost train", mine)
    return report.open_tensorboard(cfg, enabled=dist.get_rank() == 0)


def _claim_run_folder(cfg: TrainConfig) -> run_folder.RunClaim:
    """Rank 0 checks, locks and prepares the run folder; every rank gets its verdict.

    One rank decides so that the ranks cannot disagree (rank 0 moving folders aside while
    another lists them); its error is raised on every rank, none left waiting for it.
    """
    box: list[Any] = [None]
    claim = None
    if dist.get_rank() == 0:
        try:
            claim = run_folder.claim_run_folder(cfg)
            box[0] = (claim.resume_from, claim.skipped)
        except Exception as err:  # every rank raises it, below
            box[0] = err
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return claim or run_folder.RunClaim(None, *box[0])


def _train(
    cfg: TrainConfig,
    claim: run_folder.RunClaim,
    board: report.TensorBoard | None,
    watch: comm.LauncherWatch | None,
) -> TrainResult:
    rank = dist.get_rank()
    run = setup(cfg)
    meter = mfu.for_run(run)  # a collective over pp at --pp > 1
    result = TrainResult(model=run.model)
    found, skipped = claim.resume_from, claim.skipped
    if found is not None:
        state = ckpt.load(found, run.layout, run.opt)
        _check_resume(run, state)
        run.corpus.restore(state.get("data", {}))
        result.start_step = int(state["step"])
        log.info("resumed from %s at step %d (dp=%d, tp=%d)", found, result.start_step,
                 run.dp, run.tp)  # fmt: skip
    metrics = Metrics(cfg.metrics, append=result.start_step > 0, enabled=rank == 0,
                      tensorboard=board)  # fmt: skip
    if run.pipe is not None:
        log.info("pipeline: %d stages, %d micro-batches of %d per dp rank, %s",
                 cfg.pp, run.pipe.n_microbatches, run.pipe.boundary_shape[0],
                 "compiled" if cfg.compile else "eager")  # fmt: skip
    metrics.write({"event": "start", "step": result.start_step, "pp": cfg.pp, "dp": run.dp,
                   "tp": run.tp,
                   "microbatches": run.pipe.n_microbatches if run.pipe is not None else None,
                   "fsdp": run.fsdp, "compile": cfg.compile, "world": dist.get_world_size(),
                   "tp_collective_bytes_per_step": run.tp_bytes,
                   "dp_collective_bytes_per_step": run.dp_bytes,
                   "skipped_checkpoints": skipped, "data": run.corpus.source, **meter.record(),
                   **_data_info(run)})  # fmt: skip
    progress, task = progress_bar(rank == 0 and cfg.progress, cfg.steps, result.start_step)
    rates: list[float] = []
    end = cfg.stop_at or cfg.steps
    with progress, contextlib.closing(metrics):
        for step in range(result.start_step, end):
            if watch is not None:
                watch.check()
            t0 = time.perf_counter()
            loss, norm = train_step(run, step)
            dt = time.perf_counter() - t0
            if bad := divergence.nonfinite(loss, norm):
                divergence.on_nonfinite(cfg, step, lr_at(step, cfg), loss, norm, bad, metrics,
                                        result.checkpoint)  # fmt: skip
                progress.update(task, advance=1)
            else:  # the skipped steps are no point of the curve
                rate = _record_step(run, step, loss, norm, dt, metrics, meter)
                if step > result.start_step:  # the first step of a process compiles
                    rates.append(rate)
                result.losses[step], result.grad_norms[step] = loss, norm
                progress.update(task, advance=1,
                                description=report.step_description(loss, rate, meter(rate)))  # fmt: skip
            done = step + 1
            if run.held_out is not None and (
                (cfg.eval_every and done % cfg.eval_every == 0) or done == end
            ):
                result.eval_losses[step] = float(validate(run, step, metrics)["eval_loss"])
            if cfg.checkpoint_dir and (
                (cfg.save_every and done % cfg.save_every == 0) or done == end
            ):
                divergence.check_finite_parameters(run, done, result.checkpoint)
                result.checkpoint = ckpt.save(
                    cfg.checkpoint_dir, done, run.layout, run.opt, _train_state(run, done)
                )
                if cfg.keep and rank == 0:
                    ckpt.prune(cfg.checkpoint_dir, cfg.keep)
            if cfg.throttle:
                time.sleep(cfg.throttle)
    result.final_step = end
    result.tokens_per_s = sorted(rates)[len(rates) // 2] if rates else 0.0
    if rank == 0:
        curve = read_metrics(cfg.metrics) if cfg.metrics else {}
        losses = {s: r["loss"] for s, r in curve.items()} or result.losses
        target = Path(cfg.plot) if cfg.plot else default_plot(cfg)
        if losses and target is None:
            log.info("no loss-curve PNG: a run without --metrics, --checkpoint-dir or --plot "
                     "writes no files")  # fmt: skip
        elif losses:
            name = cfg.hf_config or cfg.init_from or cfg.model
            title = f"{name}, dp={run.dp} x tp={run.tp}, batch {cfg.batch} x {cfg.seq}"
            result.plot = plot_losses(losses, target, title)
            if result.plot:
                log.info("loss curve: %s", result.plot)
    dist.barrier()
    return result


def _record_step(run: Run, step: int, loss: float, norm: float, dt: float, metrics: Metrics,
                 meter: Any) -> float:  # fmt: skip
    """A finite step's metrics record and log line; its tokens/s."""
    cfg = run.cfg
    tokens = cfg.batch * cfg.seq
    rate = tokens / dt
    metrics.write({"step": step, "loss": loss, "grad_norm": norm, "lr": lr_at(step, cfg),
                   "tokens_per_s": rate, "mfu": meter(rate), "step_s": dt,
                   "tokens_seen": (step + 1) * tokens, "tp_collective_bytes": run.tp_bytes,
                   "dp_collective_bytes": run.dp_bytes})  # fmt: skip
    end = cfg.stop_at or cfg.steps
    if dist.get_rank() == 0 and (step % max(1, cfg.log_every) == 0 or step == end - 1):
        log.info("step %d loss %.4f grad_norm %.3f %.0f tok/s", step, loss, norm, rate)
    return rate


def _data_info(run: Run) -> dict[str, Any]:
    """The metrics' start record: tokenizer, EOS, held-out size (no collective)."""
    info = run.corpus.describe()
    if run.held_out is not None:
        info["eval_sequences"] = int(run.held_out.shape[0] * run.held_out.shape[1])
    return info


def configure_logging() -> None:
    """INFO on rank 0, warnings elsewhere, through rich (the package logs, never prints)."""
    from rich.logging import RichHandler

    root = logging.getLogger("boost_compiler")
    if not root.handlers:
        root.addHandler(RichHandler(show_path=False, rich_tracebacks=False))
    rank = int(os.environ.get("RANK", "0"))
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
