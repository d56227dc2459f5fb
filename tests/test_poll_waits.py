"""Polled collective waits (option ``collective_wait``): the same collectives, polled."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import boost_compiler
from boost_compiler.bench.harness import spawn
from boost_compiler.lowering import poll_waits
from boost_compiler.tp.collectives import fake_process_group
from examples.cola_llama import build, example_inputs

FUNCOL = torch.ops._c10d_functional
POLLED = {torch.ops.boost.all_reduce_polled.default, torch.ops.boost.all_gather_polled.default}


def _kinds(graph: fx.Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_function" and (
            n.target in POLLED or getattr(n.target, "namespace", "") == "_c10d_functional"
        ):
            key = f"{n.target.namespace}.{n.target._opname}"
            out[key] = out.get(key, 0) + 1
    return out


def _compiled_graphs(wait: str) -> list[dict[str, int]]:
    """Post-grad forward and backward graphs of the tiny CoLA-LLaMA at tp=2 (fake group),
    as Inductor lowers them: after the boost post-grad passes."""
    graphs: list[dict[str, int]] = []
    with fake_process_group(2):
        model = build("tiny")
        (ids,) = example_inputs(model.cfg, batch=2, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
        record = {"post_grad_custom_post_pass": lambda g: graphs.append(_kinds(g))}
        options = {"collective_wait": wait, "inductor_config": record}
        run = torch.compile(model, backend="boost", options=options)
        run(ids, labels=ids).backward()
    return graphs


def test_polled_graphs_issue_the_same_collectives() -> None:
    """Every all-reduce and all-gather paired with its wait becomes one polled op; the
    reduce-scatter (gloo's completes only inside wait()) keeps torch's wait."""
    blocked, polled = _compiled_graphs("block"), _compiled_graphs("poll")
    assert len(blocked) == len(polled) == 2  # forward, backward
    for b, p in zip(blocked, polled, strict=True):
        assert b.get("_c10d_functional.all_reduce", 0) > 0
        assert p.get("boost.all_reduce_polled", 0) == b["_c10d_functional.all_reduce"]
        assert p.get("boost.all_gather_polled", 0) == b.get(
            "_c10d_functional.all_gather_into_tensor", 0
        )
        assert "_c10d_functional.all_reduce" not in p
        assert p.get("_c10d_functional.reduce_scatter_tensor", 0) == b.get(
            "_c10d_functional.reduce_scatter_tensor", 0
        )
        # the only waits left are the reduce-scatters'
        assert p.get("_c10d_functional.wait_tensor", 0) == p.get(
            "_c10d_functional.reduce_scatter_tensor", 0
        )
    assert sum(p.get("boost.all_gather_polled", 0) for p in polled) == 1  # the LM head's


def _graph(users: int, group: str, op: Any = None) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    target = op or FUNCOL.all_reduce.default
    args = (x, "sum", group) if target is FUNCOL.all_reduce.default else (x, "sum", 2, group)
    c = g.call_function(target, args)
    waited = g.call_function(FUNCOL.wait_tensor.default, (c,))
    outs = [waited] + [g.call_function(torch.ops.aten.neg.default, (c,)) for _ in range(users - 1)]
    g.output(tuple(outs))
    return g


def test_only_a_collective_whose_one_user_is_its_wait_is_polled() -> None:
    assert poll_waits(_graph(1, "g"), "poll") == 1
    assert poll_waits(_graph(2, "g"), "poll") == 0  # another reader of the unwaited value
    assert poll_waits(_graph(1, "g", FUNCOL.reduce_scatter_tensor.default), "poll") == 0
    assert poll_waits(_graph(1, "g"), "block") == 0
    assert poll_waits(_graph(1, "no such group"), "auto") == 0  # not a live gloo group
    g = _graph(1, "g")
    poll_waits(g, "poll")
    (node,) = [n for n in g.nodes if n.op == "call_function"]
    assert node.target is torch.ops.boost.all_reduce_polled.default
    assert node.args[1:] == ("sum", "g")


def polled_values(*, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """Spawned (gloo): each polled op against torch's own collective on the same inputs."""
    from boost_compiler.lowering.poll_waits import polls
    from boost_compiler.tp.collectives import group_name_of

    name = group_name_of(None)
    torch.manual_seed(rank)
    x = torch.randn(4, 8, 3)
    out: dict[str, Any] = {"auto_polls_gloo": polls(name, "auto")}
    for op in ("sum", "max"):
        want = x.clone()
        dist.all_reduce(want, op=getattr(dist.ReduceOp, op.upper()))
        got = torch.ops.boost.all_reduce_polled(x, op, name)
        out[op] = torch.equal(got, want) and not torch.equal(got, x)
    want = torch.empty(8, 8, 3)
    dist.all_gather_into_tensor(want, x)
    out["all_gather"] = torch.equal(torch.ops.boost.all_gather_polled(x, 2, name), want)
    return out


def test_polled_ops_equal_torchs_collectives_on_every_rank() -> None:
    res = spawn("tests.test_poll_waits:polled_values", 2, {}, timeout_s=120, tag="test")
    assert "error" not in res, res.get("traceback")
    for r in res["per_rank"]:
        assert r == {"rank": r["rank"], "auto_polls_gloo": True, "sum": True, "max": True,
                     "all_gather": True}, r  # fmt: skip


@pytest.mark.parametrize("wait", ["sideways"])
def test_unknown_wait_mode_is_refused(wait: str) -> None:
    from boost_compiler.errors import OptionTypeError
    from boost_compiler.options import BoostOptions

    with pytest.raises(OptionTypeError, match="collective_wait"):
        BoostOptions.parse({"collective_wait": wait})
