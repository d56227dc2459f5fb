"""Fused, per-head q/k/v projections planned without a gather (issue 44, item 5).

One 2-process gloo world (:mod:`tests.fused_qkv_checks`), every rank asserted: Bloom's
per-head interleaved layout with its heads merged into the batch, Falcon's and
GPT-BigCode's multi-query layouts, each exact at tp=2 (eager, and compiled with the
``"eager"`` lowering; Inductor in the full tier) with no fallback and no more forward
bytes per layer than the same model with separate q/k/v projections; and the Hugging
Face families (Bloom, Falcon in its three layouts, GPT-BigCode multi-query) exact with
no fallback.
"""

from __future__ import annotations

import pytest

from tests.fused_qkv_checks import FAMILIES, FUSED
from tests.tp_harness import RTOL, result_of, run_world

LOWERINGS = {"eager": None, "compiled": "eager", "inductor": "inductor"}
NAMES = sorted({*FUSED, *FUSED.values()})


@pytest.fixture(scope="module")
def two() -> dict:
    checks = [
        (f"{n}/{how}", "tests.fused_qkv_checks:pattern", (n, lowering))
        for n in NAMES
        for how, lowering in LOWERINGS.items()
    ]
    checks += [(f"hf/{f}", "tests.fused_qkv_checks:hf_family", (f,)) for f in FAMILIES]
    checks += [
        (f"hf/{f}/compiled", "tests.fused_qkv_checks:hf_family", (f, True)) for f in FAMILIES
    ]
    # Inductor, and the HF families compiled (a cold compile per rank each): full tier only.
    slow = [key for key, *_ in checks if key.endswith("/inductor") or key.startswith("hf/") and
            key.endswith("/compiled")]  # fmt: skip
    return run_world(2, checks, slow=slow)


@pytest.mark.parametrize("how", list(LOWERINGS))
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_qkv_is_exact_with_no_fallback_and_no_more_bytes(
    two: dict, name: str, how: str
) -> None:
    res, free = result_of(two, f"{name}/{how}"), result_of(two, f"{FUSED[name]}/{how}")
    assert res["fallbacks"] == [] and free["fallbacks"] == [], (res["fallbacks"], free["fallbacks"])
    for what in ("loss_err", "grad_err", "param_err", "out_err"):
        assert res[what] <= RTOL, (what, res[what])
    for rank, rank_free in zip(res["ranks"], free["ranks"], strict=True):
        assert rank["fallbacks"] == [] and rank["grad_err"] <= RTOL
        assert rank["bytes_per_layer"] <= rank_free["bytes_per_layer"], (
            rank["wire_fwd"],
            rank_free["wire_fwd"],
        )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_exact_without_fallback(two: dict, family: str, compiled: bool) -> None:
    res = result_of(two, f"hf/{family}" + ("/compiled" if compiled else ""))
    assert res["fallbacks"] == [], res["fallbacks"]
    for what in ("logits", "loss", "grad"):
        assert max(res[what]) <= RTOL, (what, res[what])
    assert res["param"] <= RTOL, res
    for rank in res["ranks"]:
        assert max(rank["grad"]) <= RTOL and max(rank["loss"]) <= RTOL, rank


def test_heads_merged_into_the_batch_are_equal_blocks_of_the_local_merge() -> None:
    """``[b, H, s] -> [b*H, s]`` with ``H`` split: each rank's local merge is its slice of
    every sequence's heads (``S(0, blocks=[H]*b)``), the view back a plain head shard; a
    split the blocks do not line up with is refused, and ``rank_major`` undoes ``unblock``."""
    import torch

    from boost_compiler.tp.placement import S, blocks_through_view, rank_major, unblock

    merged = blocks_through_view((2, 4, 16, 8), (8, 16, 8), S(1), 2)
    assert merged == S(0, (4, 4)), merged
    assert blocks_through_view((8, 16, 8), (2, 4, 16, 8), merged, 2) == S(1)
    assert blocks_through_view((8, 16, 8), (4, 2, 16, 8), merged, 2) is None
    x = torch.randn(2, 4, 3)
    for r in range(2):
        local = x[:, 2 * r : 2 * r + 2].reshape(4, 3)  # what rank r's view computes
        assert torch.equal(local, merged.shard(x.reshape(8, 3), r, 2))
    flat = x.reshape(8, 3)
    assert torch.equal(unblock(rank_major(flat, 0, (4, 4), 2), 0, (4, 4), 2), flat)
