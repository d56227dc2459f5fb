"""Symbolic cost model: per-layer tensor-parallel communication and GEMM shapes.

Why symbolic: the same formulas explain the measured numbers on a 2-core CPU
and extrapolate them to the paper's scale (7B at TP4), and a formula can be
checked against the collectives ``parallelize`` actually inserts
(:func:`.plans.plan_comm`), so a wrong term cannot hide behind a benchmark's noise.

Symbols (all per layer of a LLaMA block; ``hd = d / H``): ``b`` batch,
``s`` sequence, ``d`` hidden, ``d_ff`` MLP width, ``r`` bottleneck rank,
``H`` / ``H_kv`` query / key-value heads, ``p`` tensor-parallel degree,
``e`` bytes per element of the activations.

Volume convention (the one that reproduces BOOST's published table, e.g. 7B,
b=4, s=4096, bf16: dense 256, standard low-rank 1328, BTP 224 MiB):

- a collective's volume is its **payload**, the size of the tensor being
  all-reduced (for an all-gather: the gathered tensor), as in nccl-tests'
  "size"; NOT the ring traffic ``2(p-1)/p`` times it, so it does not depend
  on ``p``; MiB = 2**20 bytes;
- the ``*_mib`` headline counts the activation payloads only. BOOST's BTP
  figure (7r per token) leaves out the per-token norm statistics because the
  reference code's norm is shard-local (and inexact); this project's exact
  norm all-reduces them, ``[b, s, 1]`` in fp32 (4 bytes whatever ``e``), and
  :attr:`Comm.total_bytes` includes them. For BOOST they ride in the grouped
  (coalesced) collective, still counted at 4 bytes: packing them into a bf16
  ``[H, S]`` buffer would halve that and lose the exactness.

Strategies: ``dense`` (Megatron TP of the dense model), ``standard`` (Megatron
applied to each low-rank factor pair: B split on r, A row-parallel, full-width
all-reduce), ``btp`` (what ``parallelize`` does today: one ``[b,s,r]``
all-reduce per down factor forward and per up factor input backward, plus
the norm statistics forward and backward) and ``boost`` (siblings sharing an
input grouped into one all-reduce, norm statistics fused into it, identity
backward). Per token and layer (MHA; ``kv = H_kv d / H`` replaces d for k, v):

    ============  ====================  ==========================  ============
    strategy      forward elements      backward elements           collectives
    ============  ====================  ==========================  ============
    dense         2d                    2d   (unfused: 5d)          2 / 2 (5)
    standard      5d + 2 d_ff           3d + d_ff (6d + d_ff)       7 / 4 (7)
    btp           7r + 2 stats          7r + 2 stats                9 / 9
    boost         7r + 2 stats (fused)  7r                          4 / 4
    ============  ====================  ==========================  ============

``fused=True`` counts Megatron's fused QKV / gate-up column layers (one
backward all-reduce per distinct input); ``fused=False`` one per column-
parallel module, as torch DTensor's per-module plans do (docs/benchmarks.md's measured
DTensor bytes match it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from .._logging import get_logger
from ..errors import ShardingError, UnknownConfigError

log = get_logger(__name__)

b, s, d, d_ff, r, H, H_kv, p, e = sp.symbols("b s d d_ff r H H_kv p e", positive=True, integer=True)
alpha, beta = sp.symbols("alpha beta", positive=True)  # latency (s), inverse bandwidth (s/B)
STAT_BYTES = 4  # norm statistics travel in fp32 (tp_ops.sharded_rms_norm)
MIB = 2**20
DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class LlamaDims:
    """LLaMA-family sizes. ``n_kv_heads=None`` means multi-head attention."""

    name: str
    d: int
    d_ff: int
    n_layers: int
    n_heads: int
    rank: int
    n_kv_heads: int | None = None
    vocab: int = 32000

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @classmethod
    def from_model_config(cls, cfg: Any, name: str = "model") -> LlamaDims:
        """From :class:`boost_compiler.models.cola_llama.ColaLlamaConfig` (or anything with its fields)."""
        return cls(
            name, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.rank,
            cfg.num_kv_heads, cfg.vocab_size,
        )  # fmt: skip

    def values(self, tp: int) -> dict[sp.Symbol, int]:
        sizes = (self.d, self.d_ff, self.rank, self.n_heads, self.kv_heads, tp)
        return dict(zip((d, d_ff, r, H, H_kv, p), sizes, strict=True))

    def check_divisible(self, tp: int) -> None:
        """Raise ShardingError naming the first dimension ``tp`` does not divide.

        Every strategy's shards must be whole: dense TP splits heads and d_ff,
        standard low-rank TP splits r, BTP/BOOST split d, d_ff and the heads.
        """
        if tp < 1:
            raise ShardingError(f"the tensor-parallel degree must be >= 1, got {tp}")
        for what, size in (
            ("hidden size d", self.d), ("MLP width d_ff", self.d_ff), ("rank r", self.rank),
            ("attention heads H", self.n_heads), ("key/value heads H_kv", self.kv_heads),
        ):  # fmt: skip
            if size % tp:
                raise ShardingError(
                    f"{self.name}: {what} = {size} is not divisible by the tensor-parallel "
                    f"degree tp={tp}"
                )


# 1B-30B: BOOST.md's table (r = d/4, MHA, vocab 32000); 40B: examples/cola_llama.py's preset.
CONFIGS: dict[str, LlamaDims] = {
    c.name: c
    for c in (
        LlamaDims("1b", 2048, 5472, 24, 32, 512),
        LlamaDims("3b", 3072, 8192, 28, 24, 768),
        LlamaDims("7b", 4096, 11008, 32, 32, 1024),
        LlamaDims("13b", 5120, 13824, 40, 40, 1280),
        LlamaDims("30b", 8192, 22016, 36, 64, 2048),
        LlamaDims("40b", 8192, 22016, 48, 64, 2048),
    )
}


def get_config(name: str) -> LlamaDims:
    """The built-in dims ``name`` (case-insensitive); UnknownConfigError lists the valid ones."""
    key = name.lower()
    if key not in CONFIGS:
        raise UnknownConfigError(f"unknown config {name!r}; valid configs: {', '.join(CONFIGS)}")
    return CONFIGS[key]


# -- symbolic formulas ---------------------------------------------------------


@dataclass(frozen=True)
class CommFormula:
    """One layer, one direction, per token: payload elements and collective count."""

    act: sp.Expr  # activation elements (e bytes each)
    stats: sp.Expr  # norm-statistic elements (STAT_BYTES each)
    count: sp.Expr  # collectives
    # Latent elements sent at fp32 width whatever e is: BOOST's online-norm all-reduces
    # carry their partial latents in fp32 next to the statistics
    # (tp_ops.online_rms_norm_reduce says why). Equal to `act` bytes when e = 4.
    wide: sp.Expr = sp.Integer(0)

    @property
    def elements(self) -> sp.Expr:
        return b * s * (self.act + self.wide + self.stats)

    @property
    def payload(self) -> sp.Expr:
        """Bytes per layer of the latent/activation payloads (statistics excluded)."""
        return b * s * (self.act * e + self.wide * STAT_BYTES)

    @property
    def bytes(self) -> sp.Expr:
        return self.payload + b * s * self.stats * STAT_BYTES

    @property
    def time(self) -> sp.Expr:
        """Ring all-reduce alpha-beta estimate: 2(p-1) steps, 2(p-1)/p of the payload each way."""
        return self.count * 2 * (p - 1) * alpha + 2 * (p - 1) / p * self.bytes * beta


@dataclass(frozen=True)
class StrategyFormula:
    name: str
    title: str
    forward: CommFormula
    backward: CommFormula
    gemms: tuple[tuple[str, sp.Expr, sp.Expr], ...]  # (name, K, N) per rank; M = b*s


def _cf(act: Any, stats: Any = 0, count: Any = 0, wide: Any = 0) -> CommFormula:
    return CommFormula(sp.sympify(act), sp.sympify(stats), sp.sympify(count), sp.sympify(wide))


kv = H_kv * d / H  # width of k and v (= d for MHA)
# (d_in, d_out) of the seven projections of a LLaMA block
PROJECTIONS: dict[str, tuple[sp.Expr, sp.Expr]] = {
    "q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d),
    "gate": (d, d_ff), "up": (d, d_ff), "down": (d_ff, d),
}  # fmt: skip
_COLUMN = ("q", "k", "v", "gate", "up")  # column-parallel in Megatron's dense plan


def formulas(fused: bool = True) -> dict[str, StrategyFormula]:
    """The four strategies' symbolic per-layer costs (see the module docstring)."""
    dense_gemms = tuple(
        (n, di, do / p) if n in _COLUMN else (n, di / p, do) for n, (di, do) in PROJECTIONS.items()
    )
    std_gemms = tuple(
        g for n, (di, do) in PROJECTIONS.items() for g in ((f"{n}.B", di, r / p), (f"{n}.A", r / p, do))
    )  # fmt: skip
    btp_gemms = tuple(
        g for n, (di, do) in PROJECTIONS.items() for g in ((f"{n}.B", di / p, r), (f"{n}.A", r, do / p))
    )  # fmt: skip
    merged = {"q.B": ("qkv.B", d / p, 3 * r), "gate.B": ("gate_up.B", d / p, 2 * r)}
    boost_gemms = tuple(
        merged.get(n, (n, k, nn)) for n, k, nn in btp_gemms if n not in ("k.B", "v.B", "up.B")
    )
    # BTP: 7 rank-dim payloads plus the two RMSNorms' statistics each way. Dense/standard:
    # backward all-reduces of the column layers' input gradients, one per distinct input
    # (fused) or one per module (DTensor). Standard TP: q/k/v input d, o input H*hd = d.
    dense_bwd = _cf(2 * d, 0, 2) if fused else _cf(5 * d, 0, 5)
    std_fwd = _cf(3 * d + 2 * kv + 2 * d_ff, 0, 7)  # q, k, v, o, gate, up, down outputs
    std_bwd = _cf(3 * d + d_ff, 0, 4) if fused else _cf(6 * d + d_ff, 0, 7)
    return {
        "dense": StrategyFormula(
            "dense", "dense TP (Megatron)", _cf(2 * d, 0, 2), dense_bwd, dense_gemms
        ),
        "standard": StrategyFormula(
            "standard", "standard low-rank TP", std_fwd, std_bwd, std_gemms
        ),
        "btp": StrategyFormula(
            "btp", "BTP (no grouping / online norm)", _cf(7 * r, 2, 9), _cf(7 * r, 2, 9), btp_gemms
        ),
        "boost": StrategyFormula(
            # forward: q|k|v and gate|up latents (5r) fp32 with the 2 statistics; o, down in e
            "boost",
            "BOOST (grouped, online norm)",
            _cf(2 * r, 2, 4, wide=5 * r),
            _cf(7 * r, 0, 4),
            boost_gemms,
        ),
    }


# Outside the layers, what parallelize does for an untied LM head whose logits reach the
# model's next-token cross-entropy (labels given): the final norm's statistics (forward
# and backward), one all-gather of [b, s, d] before the vocabulary-parallel head and its
# backward reduce-scatter (the hidden's gradient sums the vocabulary shards' parts, and each
# rank keeps its hidden shard of the sum: ``reduce_scatter_grads``), and the
# loss's per-token statistics over the b s tokens (``next_token_loss`` shifts the labels,
# so the last position is there with its label ignored): one all-gather of every rank's
# [log-sum-exp, target term] (p x 2 elements gathered), nothing backward.
BTP_STEP_EXTRA = (_cf(d, 1 + 2 * p, 3), _cf(d, 1, 2))
# The same model returning logits (no loss in the graph): the head is replicated.
BTP_STEP_EXTRA_LOGITS = (_cf(d, 1, 2), _cf(0, 1, 1))


def arithmetic_intensity(M: Any, K: Any, N: Any, elem_bytes: Any = e) -> sp.Expr:
    """FLOPs per byte of ``[M,K] @ [K,N]``: ``2MKN / (e (MK + KN + MN))``.

    Inputs read once and output written once (the roofline minimum). It equals
    ``2 / (e (1/M + 1/K + 1/N))``, so the smallest of M, K, N caps it: standard
    TP's K = r/p (up factor) and N = r/p (down factor) put it near or below a
    GPU's ridge point (memory bound), where BTP keeps K or N = r.
    """
    M, K, N, eb = (sp.sympify(x) for x in (M, K, N, elem_bytes))
    return 2 * M * K * N / (eb * (M * K + K * N + M * N))


# -- numbers ------------------------------------------------------------------


@dataclass(frozen=True)
class Comm:
    """One layer, one direction of one strategy, evaluated."""

    payload_bytes: int  # activation payloads (BOOST's convention)
    stats_bytes: int  # fp32 norm statistics
    elements: int
    collectives: int
    time_s: float  # alpha-beta ESTIMATE

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.stats_bytes

    @property
    def mib(self) -> float:
        return self.payload_bytes / MIB

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB


@dataclass(frozen=True)
class Gemm:
    name: str
    M: int
    K: int
    N: int
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


@dataclass(frozen=True)
class StrategyCost:
    name: str
    title: str
    forward: Comm
    backward: Comm
    gemms: tuple[Gemm, ...]

    @property
    def intensity(self) -> float:
        """The layer's GEMM FLOPs over their bytes (FLOP-weighted intensity)."""
        return sum(g.flops for g in self.gemms) / sum(g.bytes for g in self.gemms)


@dataclass(frozen=True)
class Link:
    """Alpha-beta link model; the times it gives are estimates, not measurements."""

    bandwidth_gbps: float = 300.0  # GB/s (1e9 bytes/s) per direction (A100 NVLink 3)
    latency_us: float = 2.0  # per ring step; a ring all-reduce takes 2(p-1) steps


@dataclass(frozen=True)
class CostReport:
    dims: LlamaDims
    tp: int
    batch: int
    seq: int
    dtype: str
    link: Link
    fused: bool
    strategies: dict[str, StrategyCost] = field(default_factory=dict)


def ratios(report: CostReport, way: str = "forward") -> dict[str, float]:
    """Payload ratios of every strategy to BTP and BOOST (the paper's ~5.9x)."""
    mib = {n: getattr(c, way).mib for n, c in report.strategies.items()}
    return {f"{a}/{ref}": mib[a] / mib[ref] for ref in ("btp", "boost") for a in mib if a != ref}


def _num(expr: sp.Expr, subs: dict[sp.Symbol, Any]) -> sp.Expr:
    v = sp.sympify(expr).subs(subs)
    if v.free_symbols:
        raise ValueError(f"unbound symbols {v.free_symbols} in {expr}")
    return v


def _int(expr: sp.Expr, subs: dict[sp.Symbol, Any]) -> int:
    v = _num(expr, subs)
    if not v.is_integer:
        raise ShardingError(f"{expr} = {v} is not a whole number at these sizes")
    return int(v)


def _comm(f: CommFormula, subs: dict[sp.Symbol, Any], link: Link) -> Comm:
    t_subs = {**subs, alpha: sp.Rational(str(link.latency_us)) / 10**6}
    t_subs[beta] = 1 / (sp.Rational(str(link.bandwidth_gbps)) * 10**9)
    return Comm(
        payload_bytes=_int(f.payload, subs),
        stats_bytes=_int(b * s * f.stats * STAT_BYTES, subs),
        elements=_int(f.elements, subs),
        collectives=_int(f.count, subs),
        time_s=float(_num(f.time, t_subs)),
    )


def _gemm(name: str, K: sp.Expr, N: sp.Expr, subs: dict[sp.Symbol, Any]) -> Gemm:
    m, k, n, eb = _int(b * s, subs), _int(K, subs), _int(N, subs), subs[e]
    return Gemm(name, m, k, n, 2 * m * k * n, eb * (m * k + k * n + m * n))


def cost(
    dims: LlamaDims | str,
    tp: int,
    batch: int,
    seq: int,
    dtype: str = "bf16",
    link: Link | None = None,
    fused: bool = True,
) -> CostReport:
    """Evaluate the four strategies for one model size, TP degree and micro-batch."""
    dims = get_config(dims) if isinstance(dims, str) else dims
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    dims.check_divisible(tp)
    link = link or Link()
    subs = {**dims.values(tp), b: batch, s: seq, e: DTYPE_BYTES[dtype]}
    report = CostReport(dims, tp, batch, seq, dtype, link, fused)
    for name, f in formulas(fused).items():
        report.strategies[name] = StrategyCost(
            name, f.title, _comm(f.forward, subs, link), _comm(f.backward, subs, link),
            tuple(_gemm(n, k, nn, subs) for n, k, nn in f.gemms),
        )  # fmt: skip
    log.info("cost model: %s tp=%d b=%d s=%d %s", dims.name, tp, batch, seq, dtype)
    return report


def step_bytes(
    dims: LlamaDims, tp: int, batch: int, seq: int, dtype: str, strategy: str = "boost",
    loss: bool = True,
) -> dict[str, int]:  # fmt: skip
    """Whole-step bytes and collectives of ``parallelize`` by formula, untied LM head.

    ``n_layers`` times the per-layer formula of ``strategy`` (``"boost"``: the default
    passes; ``"btp"``: ``group_linears`` and ``online_norm`` off) plus
    :data:`BTP_STEP_EXTRA` (``loss``: the model computes its cross-entropy) or
    :data:`BTP_STEP_EXTRA_LOGITS`; the counterpart of :func:`plan_comm` for the same
    model, for checking one by the other.
    """
    subs = {**dims.values(tp), b: batch, s: seq, e: DTYPE_BYTES[dtype]}
    f = formulas()[strategy]
    fwd, bwd = BTP_STEP_EXTRA if loss else BTP_STEP_EXTRA_LOGITS
    out = {}
    for way, layer, extra in (("forward", f.forward, fwd), ("backward", f.backward, bwd)):
        out[f"{way}_bytes"] = _int(dims.n_layers * layer.bytes + extra.bytes, subs)
        out[f"{way}_collectives"] = _int(dims.n_layers * layer.count + extra.count, subs)
    return out
