"""Latent attention (DeepSeek-V3's MLA) as a bottleneck (issue 16, part 2).

Detection (one process): the q chain ``q_a_proj -> RMSNorm(q_lora_rank) -> q_b_proj``
and the kv chain ``kv_a_proj_with_mqa -> split -> RMSNorm(kv_lora_rank) -> kv_b_proj``
are reported with their ranks, whether ``to_low_rank`` factored the a/b projections
(the zoo's conversion factors q's, not kv's) or not, and with a plain ``q_proj``; a
norm over the hidden, or a link through another activation, never joins two pairs.

Plan (torch's fake process group, one process): the collectives the forward and the
backward execute (profiler events of what runs, not the plan's records): per layer,
the attention's forward is the latents' all-reduce only, never a hidden-size payload;
the shared rotary key costs a ``[b, 1, s, rope]`` backward all-reduce, no gather.

Exactness (2 gloo ranks, 3 SGD steps against one device, HF's own loss): the MLA
variants here; the zoo's own ``deepseek_v3`` row is in ``tests/test_zoo.py``.

Cost model: :func:`boost_compiler.costmodel.mla_cost` against numbers worked by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import boost_compiler
from boost_compiler import costmodel as cm
from boost_compiler.errors import ShardingError
from boost_compiler.tp.collectives import fake_process_group
from tests.extras import need
from tests.tp_harness import RTOL, ops_run, run_world
from tests.zoo_checks import LAYERS, VOCAB, build

need("transformers")

B, S = 2, 16
# The zoo's tiny DeepSeek-V3: d 64, 4 heads, q_lora_rank 32, kv_lora_rank 16, rope 8.
Q_LORA, KV_LORA, ROPE, COLA_Q = 32, 16, 8, 8  # COLA_Q: to_low_rank's rank of q_a_proj
ATTN = "model.layers.{i}.self_attn."


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def _chains(family: str) -> list[tuple]:
    found = boost_compiler.detect(build(family), (_ids(),), {"use_cache": False})
    return [(b.kind, b.down, b.up, b.rank, b.latent, b.inner) for b in found if b.kind != "pair"]


def _chain(a: str, b: str, cut: int | None, rank: int, latent: int) -> tuple:
    """The chain ``a -> b`` of one layer: ``cut`` is the CoLA rank when both are factored."""
    if cut is None:
        return ("latent", f"{a}.weight", f"{b}.weight", rank, latent, ())
    inner = (f"{a}.up.weight", f"{b}.down.weight")
    return ("latent", f"{a}.down.weight", f"{b}.up.weight", cut, latent, inner)


# family -> per layer: the q chain's CoLA rank ("dense": not factored, None: no q chain),
# the kv chain's (None: dense; the zoo's conversion leaves kv's ranks at 0).
CHAINS = {
    "deepseek_v3": (COLA_Q, None),
    "deepseek_v3/dense-mla": ("dense", None),
    "deepseek_v3/no-q-lora": (None, None),
    "deepseek_v3/factored": (16, 8),
}


@pytest.mark.parametrize("family", CHAINS)
def test_detect_reports_the_latent_chains(family: str) -> None:
    """``rank``: what the down factor all-reduces (the narrowest point); ``latent``: the
    width the norm runs over and the up side reads (q_lora_rank, kv_lora_rank)."""
    q, kv = CHAINS[family]
    expected = []
    for i in range(LAYERS):
        at = ATTN.format(i=i)
        if q is not None:
            cut = None if q == "dense" else q
            expected.append(_chain(at + "q_a_proj", at + "q_b_proj", cut, Q_LORA, Q_LORA))
        kv_ends = (at + "kv_a_proj_with_mqa", at + "kv_b_proj")
        expected.append(_chain(*kv_ends, kv, KV_LORA + ROPE, KV_LORA))
    assert _chains(family) == expected


class Pairs(nn.Module):
    """Two factor pairs joined by a norm over ``mid``: a latent chain only if ``mid < d``
    and nothing but the latent (and parameters) feeds the link."""

    def __init__(self, d: int = 32, mid: int = 16, r: int = 4, other: bool = False) -> None:
        super().__init__()
        self.a_down, self.a_up = nn.Linear(d, r, bias=False), nn.Linear(r, mid, bias=False)
        self.b_down, self.b_up = nn.Linear(mid, r, bias=False), nn.Linear(r, d, bias=False)
        self.norm = nn.RMSNorm(mid)
        self.other = nn.Linear(d, mid, bias=False) if other else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a_up(F.silu(self.a_down(x)))
        if self.other is not None:
            h = h + self.other(x)  # another activation in the link: no latent
        return self.b_up(F.silu(self.b_down(self.norm(h))))


@pytest.mark.parametrize(
    ("mid", "other", "joined"), [(16, False, True), (32, False, False), (16, True, False)]
)
def test_pairs_join_through_a_latent_norm_only(mid: int, other: bool, joined: bool) -> None:
    """Joined: a norm over a 16-wide latent. Not joined: the norm is over the hidden
    (``mid == d``), or another branch is added to the latent before it."""
    found = boost_compiler.detect(Pairs(mid=mid, other=other), (torch.randn(2, 5, 32),))
    ends = [(b.kind, b.down, b.up, b.rank, b.latent) for b in found]
    if joined:
        assert ends == [("latent", "a_down.weight", "b_up.weight", 4, 16)], ends
        assert found[0].inner == ("a_up.weight", "b_down.weight")
        assert "rms_norm" in found[0].ops
    else:
        assert [e[:3] for e in ends] == [
            ("pair", "a_down.weight", "a_up.weight"), ("pair", "b_down.weight", "b_up.weight"),
        ], ends  # fmt: skip


class NormOver(nn.Module):
    """A dense ``d -> r`` and ``r -> d`` with a built-in norm between, over ``shape``."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape
        self.down, self.up = nn.Linear(32, 8, bias=False), nn.Linear(8, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.rms_norm(self.down(x), self.shape))


def test_a_norm_between_the_factors_must_be_over_the_rank_dim() -> None:
    [b] = boost_compiler.detect(NormOver((8,)), (torch.randn(2, 5, 32),))
    assert (b.kind, b.rank, b.latent, b.ops) == ("latent", 8, 8, ("rms_norm",))
    assert boost_compiler.detect(NormOver((5, 8)), (torch.randn(2, 5, 32),)) == []


# ---------------------------------------------------------------------------------
# The plan on the fake process group: what the forward and backward execute.
# ---------------------------------------------------------------------------------


def _ran(family: str, options: dict | None = None):
    """Parallelize ``family`` on the fake group; the collectives one step executes."""
    with fake_process_group(2):
        model = build(family)
        ids = _ids()
        kwargs = {"labels": ids, "use_cache": False}
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), kwargs, options=options)
        model(ids, **kwargs).loss.backward()  # compiles
        out, fwd = ops_run(lambda: model(ids, **kwargs))
        _, bwd = ops_run(out.loss.backward)
    as_pairs = [[(k, tuple(s)) for k, s, _ in ev] for ev in (fwd, bwd)]
    return model.boost_plan, *as_pairs


LATENTS = COLA_Q + KV_LORA + ROPE  # q's narrowest point (its CoLA rank) and kv_a's output
TAIL = [  # the final norm, the head's input and the returned logits (local halves), the loss
    ("all_reduce", (B, S, 1)), ("all_gather_into_tensor", (B, S, 32)),
    ("all_gather_into_tensor", (B, S, VOCAB // 2)), ("all_gather_into_tensor", (B * S, 2)),
]  # fmt: skip


def test_attention_forward_is_the_latent_all_reduce_only() -> None:
    """Default passes, every layer a dense MLP so that the whole forward is known: per
    layer ONE attention all-reduce ``[b, s, 8 + 24 + 1]`` (q's latent at its narrowest,
    kv_a's latent with the rope part, the input norm's statistic), then o, the MLP's
    gate/up (+ statistic) and down; nothing of the hidden's size before the head.

    Before latent chains, each layer's attention gathered the hidden ``[b, s, 64]`` for
    kv_a_proj_with_mqa and ran q_a / q_b as two all-reduces ``[.., 8]``, ``[.., 9]``.
    """
    plan, fwd, bwd = _ran("deepseek_v3/dense-mlp")
    layer = [(B, S, LATENTS + 1), (B, S, 16), (B, S, 2 * 16 + 1), (B, S, 16)]
    assert fwd == [("all_reduce", s) for s in layer * LAYERS] + TAIL, fwd
    assert plan.fallbacks == []
    # Backward, per layer: the f of q_b's input (8), kv_b's (16) and the rotary key's:
    # [b, 1, s, rope], not an all-gather of it expanded to every head.
    for shape in [(B, S, COLA_Q), (B, 1, S, KV_LORA), (B, 1, S, ROPE)]:
        assert bwd.count(("all_reduce", shape)) == LAYERS, bwd
    assert not [c for c in bwd if c[0].startswith("all_gather")], bwd


def test_without_grouping_each_latent_has_its_all_reduce() -> None:
    """BTP alone: the input norm's statistic, q's latent and kv's latent, one each."""
    _, fwd, _ = _ran("deepseek_v3/dense-mlp", {"group_linears": False, "online_norm": False})
    attention = [(B, S, 1), (B, S, COLA_Q), (B, S, KV_LORA + ROPE), (B, S, 16)]  # + o
    mlp = [(B, S, 1), (B, S, 16), (B, S, 16), (B, S, 16)]
    assert fwd == [("all_reduce", s) for s in (attention + mlp) * LAYERS] + TAIL, fwd


def test_placements_of_the_latent_chains() -> None:
    """a-projections row-parallel, the replicated middle (norms, q's inner factors), the
    b-projections column-parallel by heads."""
    plan, _, _ = _ran("deepseek_v3")
    a = ATTN.format(i=1)
    got = {k.removeprefix(a): str(v) for k, v in plan.params.items() if k.startswith(a)}
    assert got == {
        "q_a_proj.down.weight": "S(1)", "q_a_proj.up.weight": "R", "q_a_layernorm.weight": "R",
        "q_b_proj.down.weight": "R", "q_b_proj.up.weight": "S(0)",
        "kv_a_proj_with_mqa.weight": "S(1)", "kv_a_layernorm.weight": "R",
        "kv_b_proj.weight": "S(0)", "o_proj.down.weight": "S(1)", "o_proj.up.weight": "S(0)",
    }  # fmt: skip
    assert plan.fallbacks == []


def test_heads_must_divide_the_tensor_parallel_degree() -> None:
    """2 heads on 4 ranks: a ShardingError, before any parameter is touched."""
    with fake_process_group(4):
        model = build("deepseek_v3/dense-mlp", num_attention_heads=2, num_key_value_heads=2)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = _ids()
        with pytest.raises(ShardingError, match="heads"):
            boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------------
# Exactness on 2 ranks.
# ---------------------------------------------------------------------------------

VARIANTS = ("deepseek_v3/dense-mla", "deepseek_v3/no-q-lora", "deepseek_v3/factored")
COMPILED = ("deepseek_v3/dense-mla",)  # Inductor, a cold compile per rank: full tier only


@pytest.fixture(scope="module")
def two() -> dict:
    checks = [(k, "tests.zoo_checks:zoo_family", (k,)) for k in VARIANTS]
    checks += [(f"{k}/compiled", "tests.zoo_checks:zoo_family", (k,), {"compiled": True})
               for k in COMPILED]  # fmt: skip
    return run_world(2, checks, [f"{k}/compiled" for k in COMPILED])


@pytest.mark.parametrize("key", [*VARIANTS, *(f"{k}/compiled" for k in COMPILED)])
def test_exact_on_2_ranks(two: dict, key: str) -> None:
    res = two[key]
    if "skipped" in res:
        pytest.skip(res["skipped"])
    assert "error" not in res and "refused" not in res, res
    for rank in res["ranks"]:
        for what in ("loss", "grad", "logits"):
            assert max(rank[what]) <= RTOL, (what, rank[what])
        assert rank["param"] <= RTOL and rank["fallbacks"] == [], rank
    # each layer's attention: one latent all-reduce [b, s, q + kv + 1]: q's and kv's
    # narrowest points (no-q-lora: q_proj's CoLA rank 16) and the input norm's statistic
    q, kv = {"dense-mla": (Q_LORA, KV_LORA + ROPE), "no-q-lora": (16, KV_LORA + ROPE),
             "factored": (16, 8)}[key.split("/")[1]]  # fmt: skip
    wire = [s for name, s in res["forward_wire"] if name == "gloo:all_reduce"]
    assert wire.count([B, S, q + kv + 1]) == LAYERS, wire


# ---------------------------------------------------------------------------------
# Cost model.
# ---------------------------------------------------------------------------------


def test_mla_cost_against_hand_numbers() -> None:
    """d 64, 4 heads, q_lora 32, kv_lora 16, rope 8, nope 8, v 16, tp 2, fp32 (e = 4).

    FLOPs per rank and token: q_a 2*64*32 = 4096, kv_a 2*64*24 = 3072 (BTP: halves),
    q_b 2*32*2*16 = 2048, kv_b 2*16*2*24 = 1536, o 2*2*16*64 = 4096. Forward bytes:
    torchtitan gathers the hidden and reduce-scatters o's output, 2*64*4 = 512; BOOST
    all-reduces the latents with the statistic in fp32, (32+24+1)*4 = 228, plus o's
    64*4 = 256. Backward, both: o's all-gather 64, latents 32 + 24: (64+56)*4 = 480.
    """
    dims = cm.MlaDims("tiny", 64, 4, 32, 16, 8, 8, 16)
    got = cm.mla_cost(dims, 2, "fp32")
    titan, btp, boost = got["torchtitan"], got["btp"], got["boost"]
    assert dict(titan.gemms) == {"q_a": 4096, "kv_a": 3072, "q_b": 2048, "kv_b": 1536, "o": 4096}
    assert dict(boost.gemms) == {"q_a": 2048, "kv_a": 1536, "q_b": 2048, "kv_b": 1536, "o": 4096}
    assert (titan.flops, btp.flops, boost.flops) == (14848, 11264, 11264)
    assert (titan.forward_bytes, titan.forward_collectives) == (512, 2)
    assert (boost.forward_bytes, boost.forward_collectives) == (228 + 256, 2)
    assert (btp.forward_bytes, btp.forward_collectives) == (4 + (32 + 24 + 64) * 4, 4)
    assert titan.backward_bytes == boost.backward_bytes == 480
    assert btp.backward_bytes == 480 + 4  # the norm statistic's own all-reduce
    # bf16 (e = 2): the fused payload stays fp32
    bf16 = cm.mla_cost(dims, 2)
    assert bf16["torchtitan"].forward_bytes == 256
    assert bf16["boost"].forward_bytes == 228 + 128 and bf16["btp"].forward_bytes == 4 + 240


def test_mla_cost_deepseek_v3_at_tp8() -> None:
    """The a-projections are a fifth of torchtitan's per-rank projection FLOPs at TP8."""
    got = cm.mla_cost("deepseek-v3", 8)
    assert got["torchtitan"].flops == 73_269_248 and got["boost"].flops == 46_776_320
    assert got["torchtitan"].forward_bytes == 2 * 7168 * 2
    assert got["btp"].forward_bytes == 4 + (1536 + 576 + 7168) * 2
    with pytest.raises(ShardingError):
        cm.mla_cost("deepseek-v3", 3)
