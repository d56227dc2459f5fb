"""The cost model of one multi-head latent attention block (DeepSeek-V2/V3): torchtitan's
plan against BTP's, per rank and token, in the payload convention of the package docstring
(docs/mla.md, "Cost model")."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from .formulas import DTYPE_BYTES, STAT_BYTES

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
