"""Symbolic cost model: per-layer tensor-parallel communication and GEMM shapes.

Why symbolic: the same formulas explain the measured numbers on a 2-core CPU
and extrapolate them to the paper's scale (7B at TP4), and a formula can be
checked against the collectives ``parallelize`` actually inserts
(:func:`plan_comm`), so a wrong term cannot hide behind a benchmark's noise.

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

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy as sp

from ._logging import get_logger
from .errors import ShardingError, UnknownConfigError

if TYPE_CHECKING:
    from .tp.plan import TPPlan

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
# loss's per-token statistics over the b(s-1) shifted tokens: a max, then [sum exp, target].
BTP_STEP_EXTRA = (_cf(d, 1 + 3 * (s - 1) / s, 4), _cf(d, 1, 2))
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


# -- from a captured plan -------------------------------------------------------


@dataclass(frozen=True)
class PlanComm:
    """Bytes and collectives of a :class:`~boost_compiler.tp.plan.TPPlan`, per step."""

    forward_bytes: int
    backward_bytes: int
    forward_collectives: int
    backward_collectives: int
    rows: tuple[tuple[Any, int], ...]  # (Collective, payload bytes), in plan order


def plan_comm(plan: TPPlan) -> PlanComm:
    """Sum the plan's collectives by direction, with the payload convention above.

    Norm statistics are counted at 4 bytes: ``tp_ops`` reduces them in fp32, while
    the plan records the norm input's dtype (they differ for a bf16 model).
    """
    rows = []
    totals = {"fb": 0, "bb": 0, "fc": 0, "bc": 0}
    for c in plan.collectives:
        item = STAT_BYTES if c.reason == "norm statistics" else c.dtype.itemsize
        nbytes = math.prod(int(x) for x in c.global_shape) * item
        rows.append((c, nbytes))
        for flag, key in ((c.forward, "f"), (c.backward, "b")):
            if flag:
                totals[key + "b"] += nbytes
                totals[key + "c"] += 1
    return PlanComm(totals["fb"], totals["bb"], totals["fc"], totals["bc"], tuple(rows))


@dataclass(frozen=True)
class PipelineBoundary:
    """What one micro-batch moves across one pipeline-stage boundary (bytes, one tp rank).

    ``p2p`` is the activation sent forward (the gradient sent back is as large): the
    hidden shard ``[b/m, s, d/p]``. ``tp_gather`` is what the boundary adds inside the
    tp groups: nothing, since the stages take and return their hidden shard
    (``tp/boundary.py``; before, 4 all-gathers of ``[b/m, s, d]`` per boundary and
    micro-batch, the stage graph's replicated output and the receiver's re-assembly).
    """

    p2p: int
    tp_gather: int


def pipeline_boundary_bytes(
    b: int, s: int, d: int, p: int, m: int, elem_bytes: int = 4
) -> PipelineBoundary:
    """Bytes per micro-batch across a stage boundary of ``b x s`` tokens in ``m`` micro-batches."""
    if b % m or d % p:
        raise ValueError(f"b={b} must divide by m={m} and d={d} by p={p}")
    full = (b // m) * s * d * elem_bytes
    return PipelineBoundary(p2p=full // p, tp_gather=0)


# -- multi-head latent attention (DeepSeek-V2/V3) ----------------------------------
#
# One MLA block, per rank and token, two plans (BOOST.md, "Latent attention is a
# bottleneck too"); ``qk = nope + rope``, ``e`` bytes per activation element:
#
#   torchtitan (its DeepSeek-V3 TP plan, with its sequence parallelism): the block's
#     input is all-gathered (d); wq_a / wkv_a are replicated, every rank computes
#     them in full; wq_b / wkv_b column-parallel on heads; wo row-parallel, its output
#     reduce-scattered (d). Backward: wo's all-gather (d), the colwise inputs'
#     gradients r_q and r_kv + rope (the shared rotary key's, summed over heads).
#   BTP: the a-projections row-parallel on the hidden shard (d/p of their FLOPs),
#     one all-reduce of the latents [r_q + r_kv + rope] (``boost``: grouped, the
#     input norm's statistic in it, fp32 like every online-norm payload; ``btp``: one
#     per projection at e, and the statistic apart); the norms run on the replicated
#     latents; b-projections and wo as torchtitan's (so only the latent part differs).
#     Backward: wo's all-gather (d), the f of q_b's and kv_b's inputs (r_q, r_kv)
#     and of the rotary key (rope): the same elements as torchtitan's.
#
# FLOPs: the projections' GEMMs (2 per multiply-add). The attention core and the
# norms are the same in both plans and left out.


@dataclass(frozen=True)
class MlaDims:
    """Sizes of one MLA block (``q_lora_rank``: the q latent; DeepSeek-V2-Lite's is absent)."""

    name: str
    d: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_dim: int  # qk_rope_head_dim
    nope_dim: int  # qk_nope_head_dim
    v_dim: int  # v_head_dim


MLA_CONFIGS = {
    c.name: c
    for c in (
        MlaDims("deepseek-v3", 7168, 128, 1536, 512, 64, 128, 128),
        MlaDims("deepseek-v2", 5120, 128, 1536, 512, 64, 128, 128),
    )
}


@dataclass(frozen=True)
class MlaCost:
    """One plan for one MLA block: per rank and token, forward bytes are payloads (above)."""

    plan: str
    forward_bytes: int
    backward_bytes: int
    forward_collectives: int
    backward_collectives: int
    flops: int  # forward GEMM FLOPs per rank (backward: twice these)
    gemms: tuple[tuple[str, int], ...]  # (projection, FLOPs per rank)


def mla_cost(dims: MlaDims | str, tp: int, dtype: str = "bf16") -> dict[str, MlaCost]:
    """``torchtitan``, ``btp`` and ``boost`` for one MLA block at ``tp`` (see above)."""
    m = MLA_CONFIGS[dims] if isinstance(dims, str) else dims
    if m.n_heads % tp or m.d % tp:
        raise ShardingError(f"{m.name}: heads {m.n_heads} and d {m.d} must divide by tp={tp}")
    e, heads = DTYPE_BYTES[dtype], m.n_heads // tp
    q, kv = m.q_lora_rank, m.kv_lora_rank + m.rope_dim  # what each a-projection produces
    b_proj = [
        ("q_b", 2 * q * heads * (m.nope_dim + m.rope_dim)),
        ("kv_b", 2 * m.kv_lora_rank * heads * (m.nope_dim + m.v_dim)),
        ("o", 2 * heads * m.v_dim * m.d),
    ]
    backward = (m.d + q + kv) * e  # wo's all-gather, then the latents' and k_pe's gradients

    def plan(name: str, share: int, fwd: int, n_fwd: int, n_bwd: int, bwd: int) -> MlaCost:
        gemms = (("q_a", 2 * m.d * q // share), ("kv_a", 2 * m.d * kv // share), *b_proj)
        flops = sum(f for _, f in gemms)
        return MlaCost(name, fwd, bwd, n_fwd, n_bwd, flops, gemms)

    return {
        "torchtitan": plan("torchtitan", 1, 2 * m.d * e, 2, 3, backward),
        # the statistic travels apart, forward and backward (sharded_rms_norm)
        "btp": plan("btp", tp, STAT_BYTES + (q + kv + m.d) * e, 4, 5, backward + STAT_BYTES),
        "boost": plan("boost", tp, (q + kv + 1) * STAT_BYTES + m.d * e, 2, 4, backward),
    }
