"""The ``checkpoint`` pass on 2 processes: less saved, same collectives, same numbers."""

from __future__ import annotations

import pytest

from tests.tp_harness import FULL_TESTS, RTOL, SLOW_REASON, ranks, result_of, run_world

# Four cold compiles of a d=256 model on 2 ranks: in the full tier. CI covers the pass
# on one process (tests/test_checkpoint.py: exactness, saved bytes, cache honesty).
pytestmark = pytest.mark.skipif(not FULL_TESTS, reason=SLOW_REASON)


@pytest.fixture(scope="module")
def modes() -> dict:
    res = result_of(run_world(2, [("ckpt", "checkpoint_modes", (False,))]), "ckpt")
    print({k: v for k, v in res.items() if k != "ranks"})
    return res


def test_lowrank_checkpoint_saves_at_most_40_percent(modes: dict) -> None:
    """Per layer (1 -> 2 layers increment), b=2, s=128, d=256, r=64, tp=2, compiled."""
    print(
        f"saved bytes per layer: off {modes['per_layer_False']:,}, "
        f"lowrank {modes['per_layer_True']:,} ({modes['ratio']:.1%})"
    )
    assert modes["ratio"] <= 0.40


def test_lowrank_checkpoint_adds_no_collective(modes: dict) -> None:
    """Backward collectives, counted as they ran (gloo:* events of the backward).

    Not in Inductor's graphs: with per-block compilation the model without checkpointing
    lowers a body per block, called per layer, while checkpointing lowers one inlined graph
    (``passes/activation_checkpoint.py``). ``"full"`` is compared in ``tests/test_seams.py``.
    """
    assert modes["bwd_collectives_True"] == modes["bwd_collectives_False"] > 0


def test_checkpoint_is_exact(modes: dict) -> None:
    """Every rank, off and lowrank: loss and each gathered gradient (element-wise) against
    the single-device model run eagerly (not through the boost backend)."""
    for r in ranks(modes):
        for mode in ("False", "True"):
            assert r[f"loss_err_{mode}"] <= RTOL, (mode, r[f"loss_err_{mode}"])
            assert r[f"grad_err_{mode}"] <= RTOL, (mode, r[f"grad_worst_{mode}"])
