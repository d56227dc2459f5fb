"""The planner chooses between exact plans by cost, and predicts what it sends (issue 27).

One 2-process gloo world (:mod:`tests.planner_checks`), every rank asserted. The hybrid
model (low-rank attention, dense SwiGLU MLP): its MLP's row-parallel output is
reduce-scattered onto the residual's shards (Megatron-SP's choice, where the plan used to
all-reduce and slice), the choice and its alternative are in ``plan.choices``, the model
trains exactly against one device, and the bytes gloo sent in a step equal the planner's
prediction for the graph that ran. The same for the dense twin of the CoLA-LLaMA (no
bottleneck at all). Inductor variants in the full tier.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import boost_compiler
from boost_compiler.tp.groups import fake_process_group
from tests.planner_checks import SPEC
from tests.tp_harness import RTOL, run_world

SLOW = ["hybrid/compiled", "dense/compiled"]


@pytest.fixture(scope="module")
def two() -> dict:
    checks = [(k, "tests.planner_checks:planned", (k,)) for k in ("hybrid", "dense")]
    checks += [(k, "tests.planner_checks:planned", (k.split("/")[0],), {"compiled": True})
               for k in SLOW]  # fmt: skip
    return run_world(2, checks, SLOW)


def _result(two: dict, key: str) -> dict:
    res = two[key]
    if "skipped" in res:
        pytest.skip(res["skipped"])
    assert "error" not in res, res["error"]
    return res


@pytest.mark.parametrize("key", ["hybrid", "dense", *SLOW])
def test_planned_exact_and_as_predicted(two: dict, key: str) -> None:
    res = _result(two, key)
    assert res["fallbacks"] == [], res["fallbacks"]
    for what in ("loss_err", "grad_err", "param_err"):
        assert res[what] <= RTOL, (what, res[what])
    for rank in res["ranks"]:
        assert rank["grad_err"] <= RTOL
        # what gloo sent in a step is what the planner predicted, byte for byte
        assert rank["sent_bytes"] == rank["predicted_bytes"] > 0, rank


def test_the_dense_mlp_output_is_reduce_scattered(two: dict) -> None:
    """As every rank executed it: each layer's MLP output (row-parallel, partial sums of
    the hidden) is reduce-scattered onto the residual's shard, op and payload ``[H, b, s]``
    (the scattered hidden first), and no forward all-reduce carries the hidden
    ``[b, s, H]`` (the alternative: all-reduce, then slice). The plan's record of the
    choice, with its alternative, says the same."""
    res = _result(two, "hybrid")
    b, s, h, layers = (SPEC[k] for k in ("batch", "seq", "d", "layers"))
    for rank in res["ranks"]:
        fwd, bwd = rank["ran"]["forward"], rank["ran"]["backward"]
        assert fwd.count(["reduce_scatter_tensor", [h, b, s]]) == layers, fwd
        assert ["all_reduce", [b, s, h]] not in fwd, fwd
        # backward: each scatter's all-gather of the gradient shards [b, s, H / 2]
        assert bwd.count(["all_gather_into_tensor", [b, s, h // 2]]) == layers, bwd
    downs = [c for c in res["choices"] if "mlp.down_proj" in c[0]]
    assert downs and all(c[1] == "reduce-scatter" for c in downs), res["choices"]
    assert all(c[2] == ["all-reduce", "reduce-scatter"] for c in downs)
    assert {"layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight"} <= set(res["sharded"])


def test_a_norm_before_up_factors_is_weighed_by_size() -> None:
    """The hybrid's MLP norm, read by up factors that take it whole: small activations are
    latency-bound (gather the input, normalise whole: no statistics' all-reduces), large
    ones bandwidth-bound (normalise the shard and gather the output once; its gradient is
    then one reduce-scatter, where the whole norm's output sends it back through f, an
    all-reduce). Structure only (the fake group): the choice, its alternatives' predicted
    costs, and the decision line that reports it."""
    from benchmarks.hybrid_mlp import make_hybrid
    from boost_compiler.bench.harness import ModelSpec

    chosen = {}
    for seq in (16, 1024):
        model = make_hybrid(ModelSpec(d=64, ff=176, rank=16, layers=3, heads=4, vocab=256,
                                      seq=seq))  # fmt: skip
        ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
        with fake_process_group(2):
            boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
        norms = [c for c in model.boost_plan.choices if "mlp_norm" in c.where]
        assert norms, model.boost_plan.choices
        for c in norms:
            assert set(c.seconds) == {"sharded", "gathered, then whole"}, c
            assert c.chosen == min(c.seconds, key=c.seconds.__getitem__), c
        chosen[seq] = {c.chosen for c in norms}
        said = [d for d in model.boost_plan.decisions if "mlp_norm" in d]
        assert said and "weighed against the alternatives" in said[0], said
    assert chosen == {16: {"gathered, then whole"}, 1024: {"sharded"}}, chosen
