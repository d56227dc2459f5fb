"""Validation: the mean next-token loss of the held-out sequences, and its perplexity.

The held-out set (:func:`.data.open_eval`) is a fixed ``[batches, batch, seq]`` tensor,
split over dp like a training batch (each dp rank its disjoint rows, the tp ranks of a
dp group the same rows). Every row has ``seq`` tokens, so the mean of the per-batch,
per-rank mean losses is the mean over all held-out tokens, at any (pp, dp, tp) layout.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from .._logging import get_logger

log = get_logger(__name__)


def evaluate(run: Any, held_out: torch.Tensor) -> dict[str, float | int]:
    """``eval_loss`` (nats per token), ``eval_ppl`` = exp(loss), and the sizes; a collective.

    ``run`` is the loop's ``_Run`` (its forward, device, dp mesh). Runs under ``no_grad``:
    no activations kept for a backward; a compiled forward may compile once more for it.
    """
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for batch in held_out:
            ids = batch.chunk(run.dp, dim=0)[run.dp_rank].to(run.device)
            # --pp > 1: the schedule's forward-only pass (the same micro-batches as a step)
            loss = run.pipe.evaluate(ids) if run.pipe is not None else run.forward(ids, labels=ids)
            total += loss.detach().double().cpu()
    mean = total / held_out.shape[0]
    if run.dp > 1:
        group = run.mesh["dp"].get_group()
        mean = mean.to(run.device)
        dist.all_reduce(mean, group=group)
        mean = mean.cpu() / run.dp
    value = float(mean.item())
    return {"eval_loss": value, "eval_ppl": math.exp(min(value, 700.0)),
            "eval_sequences": int(held_out.shape[0] * held_out.shape[1]),
            "eval_tokens": int(held_out.numel())}  # fmt: skip


def validate(run: Any, step: int, metrics: Any) -> dict[str, float | int]:
    """:func:`evaluate` after step ``step``, written to the metrics as ``"event": "eval"``."""
    t0 = time.perf_counter()
    rec = evaluate(run, run.held_out)
    metrics.write({"event": "eval", "step": step, **rec, "eval_s": time.perf_counter() - t0})
    if dist.get_rank() == 0:
        log.info("step %d eval loss %.4f perplexity %.2f", step, rec["eval_loss"], rec["eval_ppl"])
    return rec
