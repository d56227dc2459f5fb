"""Shard-aware replacements the sharding pass puts into graphs.

Each takes the local shard of the last dimension and returns exactly what the
single-device op returns for that shard, using a small all-reduce (for the loss,
all-gather) of per-token statistics. They are plain Python functions called from
FX nodes: AOTAutograd traces through them, so their collectives appear in the
forward and backward graphs like any other functional collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.ops import value_of
from .collectives import (
    Comm,
    communicates,
    copy_to_tp,
    output_payload,
    reduce_from_tp,
    statistics_payload,
)

# Rows of the communication table (collectives.COMMUNICATION), one per collective a
# call performs. Norm statistics: a [..., 1] fp32 all-reduce forward, and the f on
# the scale (copy_to_tp) all-reduces the same size backward.
_NORM_STATISTIC = Comm(
    "all_reduce", True, True, statistics_payload(0, lambda n: 1), "norm statistics"
)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype statistics are accumulated in: fp32, or the input's if wider."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _latents(node: fx.Node) -> int:
    """The summed last sizes of the partials an online-norm kernel all-reduces."""
    return sum(value_of(p).shape[-1] for p in node.args[0])


# The partials and the fp32 statistics (RMSNorm: sum of squares; LayerNorm: + sum)
# in one all-reduce; the reduce is g, so nothing goes back.
_ONLINE_RMS = Comm(
    "all_reduce", True, False, statistics_payload(1, lambda n: _latents(n) + 1),
    "online norm + row-parallel",
)  # fmt: skip
_ONLINE_LAYER = Comm(
    "all_reduce", True, False, statistics_payload(3, lambda n: _latents(n) + 2),
    "online norm + row-parallel",
)  # fmt: skip


@communicates(Comm("all_reduce", True, False, output_payload, "reduction"))
def sharded_sum(x: torch.Tensor, dim: int, keepdim: bool, full: int, group: str) -> torch.Tensor:
    """``x.sum(dim)`` over a dim split across the group (``full`` is its global size)."""
    return reduce_from_tp(x.sum(dim, keepdim=keepdim), group)


@communicates(Comm("all_reduce", True, False, output_payload, "reduction"))
def sharded_mean(x: torch.Tensor, dim: int, keepdim: bool, full: int, group: str) -> torch.Tensor:
    """``x.mean(dim)`` over a dim split across the group."""
    return reduce_from_tp(x.sum(dim, keepdim=keepdim), group) / full


@communicates(_NORM_STATISTIC)
def sharded_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, d: int, group: str
) -> torch.Tensor:
    """``torch.rms_norm(x_full, (d,), weight_full, eps)`` restricted to this shard.

    Statistics in fp32 (as torch computes them for low-precision inputs); the
    global sum of squares is one all-reduce of ``[..., 1]``. ``copy_to_tp``
    sums the partial gradients of the scale in the backward.
    """
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    xf = _acc(x)
    ss = reduce_from_tp(xf.pow(2).sum(-1, keepdim=True), group)
    inv = copy_to_tp(torch.rsqrt(ss / d + eps), group)
    y = (xf * inv).to(x.dtype)
    return y * weight if weight is not None else y


@communicates(_NORM_STATISTIC, _NORM_STATISTIC)  # mean, variance
def sharded_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float | None,
    d: int,
    group: str,
) -> torch.Tensor:
    """``F.layer_norm(x_full, (d,), weight_full, bias_full, eps)`` on this shard.

    Two-pass statistics (mean, then centred sum of squares), as torch does,
    so the fp32 result does not suffer the cancellation of E[x^2] - E[x]^2.
    """
    eps = 1e-5 if eps is None else eps
    xf = _acc(x)
    mean = copy_to_tp(reduce_from_tp(xf.sum(-1, keepdim=True), group) / d, group)
    centred = xf - mean
    var = reduce_from_tp(centred.pow(2).sum(-1, keepdim=True), group) / d
    y = (centred * copy_to_tp(torch.rsqrt(var + eps), group)).to(x.dtype)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def sharded_dropout(
    x: torch.Tensor, p: float, training: bool, dim: int, rank: int, world: int
) -> torch.Tensor:
    """``F.dropout`` of a shard: this rank's slice of one mask drawn for the global shape.

    Every rank of a tensor-parallel group draws from the same random stream
    (``parallelize`` synchronises it), so dropping the local shard directly
    would give each rank the *same* mask pattern: correlated across shards.
    Drawing the global mask and keeping this rank's slice gives independent,
    correctly distributed masks per shard and keeps the streams in lockstep
    (every rank consumes the same numbers), which is what keeps dropout on
    replicated tensors bit-identical across ranks. The cost is p times the
    random numbers of the shard, only where dropout is on.
    """
    if not training or p == 0.0:
        return x
    shape = list(x.shape)
    shape[dim] *= world
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    return x * keep.narrow(dim, rank * x.shape[dim], x.shape[dim]) / (1.0 - p)


def batched_linear(
    xs: list[torch.Tensor], ws: list[torch.Tensor], bs: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """``[F.linear(x, w, b) for ...]`` for same-shape weights as one ``bmm``.

    The inputs share their shape too (sibling latents of one token batch), so
    stacking them is a copy of ``n`` narrow ``[..., r]`` tensors; the stacked
    weights are ``n`` small ``[d_out/p, r]`` matrices.
    """
    x = torch.stack(xs)
    lead = x.shape[1:-1]
    y = torch.bmm(x.reshape(len(xs), -1, x.shape[-1]), torch.stack(ws).transpose(1, 2))
    if bs is not None:
        y = y + torch.stack(bs).unsqueeze(1)
    return list(y.reshape(len(xs), *lead, y.shape[-1]).unbind(0))


@communicates(_ONLINE_RMS)
def online_rms_norm_reduce(
    partials: list[torch.Tensor], x: torch.Tensor, eps: float | None, d: int, group: str
) -> list[torch.Tensor]:
    """Row-parallel GEMMs after an RMSNorm, with the norm deferred into their all-reduce.

    ``partials[i]`` is ``(x * w) @ A_i`` on this rank's hidden shard. RMSNorm
    scales each token by ``rsqrt(mean(x^2) + eps)``, a per-token scalar, and a
    GEMM over the hidden dim commutes with it, so
    ``rms_norm(x) @ A = rsqrt(sum(x^2)/d + eps) * ((x * w) @ A)``: exact. The
    local sum of squares rides in the SAME all-reduce as the partials.

    Precision: the payload is fp32 whatever the activations' dtype. The
    statistic must keep fp32 accuracy (torch computes norm statistics in
    fp32), and a bf16 sum of bf16 pieces cannot give that; splitting the
    statistic into bf16 hi/lo parts does not help either, because the
    collective rounds each partial SUM to bf16. Upcasting the bf16 partials
    costs 2 bytes per latent element on the wire and makes their sum more
    accurate than the single-device bf16 GEMM output, which is then rounded
    back to the activation dtype.
    """
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    sizes = [p.shape[-1] for p in partials]
    ss = _acc(x).pow(2).sum(-1, keepdim=True)
    total = reduce_from_tp(torch.cat([*(_acc(p) for p in partials), ss], -1), group)
    *sums, ss_total = total.split([*sizes, 1], -1)
    scale = torch.rsqrt(ss_total / d + eps)
    return [(s * scale).to(p.dtype) for s, p in zip(sums, partials, strict=True)]


@communicates(_ONLINE_LAYER)
def online_layer_norm_reduce(
    partials: list[torch.Tensor],
    w_partials: list[torch.Tensor],
    b_partials: list[torch.Tensor] | None,
    x: torch.Tensor,
    eps: float | None,
    d: int,
    group: str,
) -> list[torch.Tensor]:
    """LayerNorm deferred into the row-parallel all-reduce (see the RMSNorm version).

    ``layer_norm(x) @ A = rstd * ((x*w) @ A - mean * (w @ A)) + b @ A`` with
    ``mean, rstd`` from the token's sum and sum of squares. ``w @ A`` and
    ``b @ A`` (``w_partials`` / ``b_partials``, one ``[r]`` vector per factor)
    are partial too; they travel flattened at the end of the same payload.
    The variance is ``E[x^2] - E[x]^2`` in fp32: one pass, so it can be sent
    with the partials; it loses accuracy only when ``|mean| >> std``.
    """
    eps = 1e-5 if eps is None else eps
    sizes = [p.shape[-1] for p in partials]
    xf = _acc(x)
    per_token = torch.cat(
        [*(_acc(p) for p in partials), xf.sum(-1, keepdim=True), xf.pow(2).sum(-1, keepdim=True)],
        -1,
    )
    consts = torch.cat([_acc(q) for q in [*w_partials, *(b_partials or [])]])
    flat = reduce_from_tp(torch.cat([per_token.flatten(), consts]), group)
    tokens = flat[: per_token.numel()].view(per_token.shape)
    *sums, s1, s2 = tokens.split([*sizes, 1, 1], -1)
    rest = flat[per_token.numel() :]
    w_a = rest[: sum(sizes)].split(sizes)
    b_a = rest[sum(sizes) :].split(sizes) if b_partials else [None] * len(sizes)
    mean = s1 / d
    rstd = torch.rsqrt((s2 / d - mean * mean).clamp_min(0) + eps)
    out = []
    for s, wa, ba, p in zip(sums, w_a, b_a, partials, strict=True):
        y = rstd * (s - mean * wa)
        out.append((y + ba if ba is not None else y).to(p.dtype))
    return out


def _loss_statistics(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype]:
    """fp32 ``[p*N, 2]``: every rank's ``[N, 2]`` loss statistics, gathered."""
    return (node.args[7] * value_of(node.args[0]).shape[0], 2), torch.float32


def _target_logit(z: torch.Tensor, target: torch.Tensor, lo: int) -> torch.Tensor:
    """``z[i, target[i] - lo]`` where this rank holds the target's column, else 0.

    Compiled, the column is picked by comparing it with the column index: gather's backward
    is a scatter into a zeroed ``[N, V/p]`` buffer, two more passes over the logits' size
    that Inductor does not fuse (with a fresh page-faulted buffer each step: the loss's
    backward took longer on half the vocabulary than one process's on all of it); the
    comparison's backward is element-wise and fuses into the softmax's single pass. Eager,
    where nothing fuses and the comparison would materialise two ``[N, V/p]`` tensors,
    gather. The two are equal exactly (a row's sum of zeros and one logit is that logit).
    """
    part = z.shape[-1]
    if torch.compiler.is_compiling():
        hit = torch.arange(lo, lo + part, device=z.device) == target.unsqueeze(-1)
        return torch.where(hit, z, z.new_zeros(())).sum(-1)
    inside = (target >= lo) & (target < lo + part)
    idx = (target - lo).clamp(0, part - 1).unsqueeze(-1)
    return torch.where(inside, z.gather(-1, idx).squeeze(-1), z.new_zeros(()))


@communicates(Comm("all_gather", True, False, _loss_statistics, "loss statistics"))
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    vocab: int,
    rank: int,
    world: int,
    group: str,
) -> torch.Tensor:
    """``F.cross_entropy(logits_full, target, ...)`` from this rank's vocabulary columns.

    ``logits`` is ``[N, V/p]``: columns ``[rank*V/p, (rank+1)*V/p)`` of the full
    ``[N, V]``. An online softmax: in one pass over its columns each rank computes,
    per token, its local log-sum-exp and its part of the target term (the target's
    logit if it holds it, ``(1-e) z_t + e * sum_c z_c / V`` with label smoothing
    ``e``); one all-gather of these ``[N, 2]`` and a stable log-sum-exp over the
    ranks give the loss. The gathered statistics are constants except this rank's
    own row, which stays the live local value: the loss's gradient with respect to
    this rank's logits flows only through it, so the backward (the global softmax
    minus the one-hot, smoothed) is local with no collective. Statistics in fp32;
    the result in the logits' dtype, as torch's. Matches torch's definition of
    label smoothing (``(1-e) * nll + e * mean_c(-log p_c)``) and of ``mean`` with
    ignored targets (divided by the number of targets that are not ignored).
    """
    from .collectives import _c10d

    z = _acc(logits)
    part = z.shape[-1]
    lo = rank * part
    # stable, and -inf (not NaN) for a shard of -inf logits
    lse_local = torch.logsumexp(z, -1)
    picked = _target_logit(z, target, lo)
    if label_smoothing:
        picked = (1 - label_smoothing) * picked + label_smoothing / vocab * z.sum(-1)
    local = torch.stack([lse_local, picked], -1)
    every = _c10d.wait_tensor(
        _c10d.all_gather_into_tensor(local.detach().contiguous(), world, group)
    ).view(world, *local.shape)
    every = torch.cat([every[:rank], local.unsqueeze(0), every[rank + 1 :]])
    loss = torch.logsumexp(every[..., 0], 0) - every[..., 1].sum(0)
    valid = target != ignore_index
    loss = torch.where(valid, loss, torch.zeros_like(loss)).to(logits.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().to(loss.dtype)


def vocab_shard_embedding(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, lo: int
) -> torch.Tensor:
    """This rank's part of ``F.embedding(ids, W)`` for ``weight = W[lo : lo + V/p]``.

    Rows of ids inside the shard, zeros for the others: summed over the ranks, the
    full lookup. ``padding_idx`` is local (``None`` when the padding row is on
    another rank). The zeros come from ``masked_fill``, whose backward also zeroes
    the gradient of the ids outside the shard, so they add nothing to row 0.
    """
    local = ids - lo
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight, padding_idx)
    return rows.masked_fill(outside.unsqueeze(-1), 0)


def expert_parallel_ffn(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    offs: torch.Tensor,
    ffn: torch.nn.Module,
    first: int,
) -> torch.Tensor:
    """This rank's experts ``first .. first + E/p`` of a MoE block (``rules/expert_parallel``):
    their rows as one device computes them, zeros elsewhere (summed over ranks: the block).

    ``x`` holds every routed row, sorted by expert; ``offs`` each expert's end row. The
    rank's experts own rows ``[start, end)``. The rows are rolled so that range comes first,
    the grouped GEMMs ``ffn`` run on the local weights with the local ends (rows past them
    are skipped, and ``torch._grouped_mm`` leaves them unwritten), and the rows are rolled
    back. Masking before and after the GEMMs keeps what the kernel leaves unwritten out of
    the value and out of ``x``'s gradient; the gate between the GEMMs is row-wise, so it
    never mixes an unwritten row into a written one. Fixed shapes, no host sync.
    """
    n, local = x.shape[0], w_up.shape[0]
    ends = offs[first : first + local]
    start = offs[first - 1] if first else torch.zeros((), dtype=offs.dtype, device=offs.device)
    rows = torch.arange(n, device=x.device)
    mine = (rows < ends[-1] - start).unsqueeze(-1)
    y = ffn(torch.where(mine, x[(rows + start) % n], 0), w_up, w_down, ends - start)
    return torch.where(mine, y, 0)[(rows - start) % n]


def one_kv_head_attention(head: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """``F.scaled_dot_product_attention`` of this rank's query heads with the one key/value
    head they share (``head``), from every key/value head held whole (``rules/matrix``):
    grouped-query attention with fewer key/value heads than ranks. The heads ``enable_gqa``
    would pair them with, so the same values."""
    k, v = k.narrow(1, head, 1), v.narrow(1, head, 1)
    return F.scaled_dot_product_attention(q, k, v, *args, **kwargs)
