"""Collectives as start/wait pairs (options ``collective_wait``, ``overlap_comm``): the
same collectives, waited for by polling, with independent work scheduled between."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import boost_compiler
from boost_compiler.bench.harness import spawn
from boost_compiler.lowering import reorder, split_collectives
from boost_compiler.tp.collectives import fake_process_group
from examples.cola_llama import build, example_inputs

FUNCOL = torch.ops._c10d_functional
BOOST = {
    torch.ops.boost.all_reduce_start_.default,
    torch.ops.boost.all_gather_start.default,
    torch.ops.boost.collective_wait.default,
    torch.ops.boost.collective_wait_.default,
    torch.ops.boost.scatter_wait.default,
}


def _kinds(graph: fx.Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_function" and (
            n.target in BOOST or getattr(n.target, "namespace", "") == "_c10d_functional"
        ):
            key = f"{n.target.namespace}.{n.target._opname}"
            out[key] = out.get(key, 0) + 1
    return out


def _compiled_graphs(wait: str, overlap: bool = True) -> list[dict[str, int]]:
    """Post-grad forward and backward graphs of the tiny CoLA-LLaMA at tp=2 (fake group),
    as Inductor lowers them: after the boost post-grad passes."""
    graphs: list[dict[str, int]] = []
    with fake_process_group(2):
        model = build("tiny")
        (ids,) = example_inputs(model.cfg, batch=2, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
        record = {"post_grad_custom_post_pass": lambda g: graphs.append(_kinds(g))}
        options = {"collective_wait": wait, "overlap_comm": overlap, "inductor_config": record}
        run = torch.compile(model, backend="boost", options=options)
        run(ids, labels=ids).backward()
    return graphs


def test_split_graphs_issue_the_same_collectives() -> None:
    """Every all-reduce and all-gather paired with its wait becomes a start and a
    collective_wait; the reduce-scatter keeps torch's wait where gloo does not move it (here
    a fake group; on gloo: ``test_split_ops_equal_torchs_collectives_on_every_rank``); with
    blocking waits and no overlap, torch's collectives stay untouched."""
    blocked, split = _compiled_graphs("block", overlap=False), _compiled_graphs("poll")
    # forward and backward, of the decoder block (a region: compile_blocks) and of the rest
    assert len(blocked) == len(split) == 4
    for b, p in zip(blocked, split, strict=True):
        assert b.get("_c10d_functional.all_reduce", 0) > 0
        assert not any(k.startswith("boost.") for k in b)
        # all-reduces reduce in place into a clone and are waited for in place; all-gathers
        # keep their out-of-place pair
        assert p.get("boost.all_reduce_start_", 0) == b["_c10d_functional.all_reduce"]
        assert p["boost.collective_wait_"] == p["boost.all_reduce_start_"]
        assert p.get("boost.all_gather_start", 0) == b.get(
            "_c10d_functional.all_gather_into_tensor", 0
        )
        assert p.get("boost.collective_wait", 0) == p.get("boost.all_gather_start", 0)
        assert "_c10d_functional.all_reduce" not in p
        assert p.get("_c10d_functional.reduce_scatter_tensor", 0) == b.get(
            "_c10d_functional.reduce_scatter_tensor", 0
        )
        # the only torch waits left are the reduce-scatters'
        assert p.get("_c10d_functional.wait_tensor", 0) == p.get(
            "_c10d_functional.reduce_scatter_tensor", 0
        )
    # the LM head's, and the vocabulary-parallel loss's one [N, 2] statistics gather
    assert sum(p.get("boost.all_gather_start", 0) for p in split) == 2


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


def test_only_a_collective_whose_one_user_is_its_wait_is_split() -> None:
    assert split_collectives(_graph(1, "g"), "poll") == 1
    assert split_collectives(_graph(2, "g"), "poll") == 0  # another reader of the unwaited
    assert split_collectives(_graph(1, "g", FUNCOL.reduce_scatter_tensor.default), "poll") == 0
    # without overlap (post_grad), a collective that would block stays torch's own
    assert split_collectives(_graph(1, "no such group"), "auto", split_blocking=False) == 0
    assert split_collectives(_graph(1, "g"), "block", split_blocking=False) == 0
    assert split_collectives(_graph(1, "g"), "poll", split_blocking=False) == 1
    for mode, group, polls in (("poll", "g", True), ("block", "g", False),
                               ("auto", "no such group", False)):  # fmt: skip
        g = _graph(1, group)
        assert split_collectives(g, mode) == 1
        clone, start, wait = [n for n in g.nodes if n.op == "call_function"]
        assert clone.target is torch.ops.aten.clone.default and clone.args[0].name == "x"
        assert start.target is torch.ops.boost.all_reduce_start_.default
        assert start.args == (clone, "sum", group)
        assert wait.target is torch.ops.boost.collective_wait_.default
        assert wait.args == (clone, polls)  # auto polls live gloo groups only
        # the wait's reader reads the clone, reduced in place, after the wait
        (out,) = [n for n in g.nodes if n.op == "output"]
        assert out.args[0] == (clone,)
        order = list(g.nodes)
        assert order.index(clone) < order.index(start) < order.index(wait) < order.index(out)


def test_an_all_gather_sends_a_buffer_no_kernel_can_reuse_before_its_wait() -> None:
    """gloo reads an all-gather's input until the wait: the start is given a clone that
    only it and the wait read, so Inductor keeps the buffer, unwritten, until the wait
    (red before: a backward's weight-gradient GEMM, scheduled between start and wait,
    was written into the input buffer Inductor had freed after the start, and the peer
    received it; tests/test_expert_parallel.py's checkpoint case, 0.99 off)."""
    g = fx.Graph()
    x = g.placeholder("x")
    gathered = g.call_function(FUNCOL.all_gather_into_tensor.default, (x, 2, "g"))
    g.output(g.call_function(FUNCOL.wait_tensor.default, (gathered,)))
    assert split_collectives(g, "poll") == 1
    clone, start, wait = [n for n in g.nodes if n.op == "call_function"]
    assert clone.target is torch.ops.aten.clone.default and clone.args == (x,)
    assert start.target is torch.ops.boost.all_gather_start.default
    assert start.args == (clone, 2, "g") and wait.args == (start, True, clone)
    assert set(clone.users) == {start, wait} and set(x.users) == {clone}


def polled_values(*, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """Spawned (gloo): each polled op against torch's own collective on the same inputs."""
    from boost_compiler.lowering.poll_waits import polls
    from boost_compiler.tp.collectives import group_name_of

    name = group_name_of(None)
    torch.manual_seed(rank)
    x = torch.randn(4, 8, 3)
    out: dict[str, Any] = {"auto_polls_gloo": polls(name, "auto", x.device)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a once-per-process warning is seen here too
        for op in ("sum", "max"):
            want = x.clone()
            dist.all_reduce(want, op=getattr(dist.ReduceOp, op.upper()))
            buf = x.clone()
            torch.ops.boost.all_reduce_start_(buf, op, name)
            torch.ops.boost.collective_wait_(buf, True)
            out[op] = torch.equal(buf, want) and not torch.equal(buf, x)
        want = torch.empty(8, 8, 3)
        dist.all_gather_single(want, x)
        started = torch.ops.boost.all_gather_start(x, 2, name)
        done = torch.ops.boost.collective_wait(started, False, x)
        out["all_gather"] = torch.equal(done, want)
        # a reduce-scatter on gloo: the in-place all-reduce and this rank's chunk of it
        g = _graph(1, name, FUNCOL.reduce_scatter_tensor.default)
        next(iter(g.nodes)).meta["val"] = x
        out["reduce_scatter_split"] = split_collectives(g, "auto")
        ops = [n.target for n in g.nodes if n.op == "call_function"]
        out["reduce_scatter_ops"] = [f"{op.namespace}.{op._opname}" for op in ops]
        _, start, wait = [n for n in g.nodes if n.op == "call_function"]
        out["reduce_scatter_wait_reads_the_buffer"] = wait.args[0] is start.args[0]
        want = torch.empty(2, 8, 3)
        dist.reduce_scatter_single(want, x)
        (got,) = fx.GraphModule(torch.nn.Module(), g)(x)
        out["reduce_scatter"] = torch.equal(got, want) and not torch.equal(got, x[2 * rank :][:2])
    # issue 42: torch's deprecation of a call of ours, printed to every user
    out["warnings"] = [str(w.message) for w in caught if w.category is FutureWarning]
    return out


def test_split_ops_equal_torchs_collectives_on_every_rank() -> None:
    res = spawn("tests.test_poll_waits:polled_values", 2, {}, timeout_s=120, tag="test")
    assert "error" not in res, res.get("traceback")
    for r in res["per_rank"]:
        assert r == {"rank": r["rank"], "auto_polls_gloo": True, "sum": True, "max": True,
                     "all_gather": True, "reduce_scatter_split": 1,
                     "reduce_scatter_ops": ["aten.clone", "boost.all_reduce_start_",
                                            "boost.scatter_wait"],
                     "reduce_scatter_wait_reads_the_buffer": True,
                     "reduce_scatter": True, "warnings": []}, r  # fmt: skip


@pytest.mark.parametrize("wait", ["sideways"])
def test_unknown_wait_mode_is_refused(wait: str) -> None:
    from boost_compiler.errors import OptionTypeError
    from boost_compiler.options import BoostOptions

    with pytest.raises(OptionTypeError, match="collective_wait"):
        BoostOptions.parse({"collective_wait": wait})


class _Node:
    """A stand-in scheduler node: a name, the op it runs, its dependencies' buffer names."""

    def __init__(self, name: str, op: Any = None, deps: tuple[str, ...] = ()) -> None:
        self.name, self.node = name, type("K", (), {"op_overload": op})()
        self.unmet_dependencies = [type("D", (), {"name": d})() for d in deps]

    def get_buffer_names(self) -> list[str]:
        return [self.name]


def test_reorder_starts_early_waits_late_dependencies_kept() -> None:
    """A backward layer as Inductor fuses it: the input-gradient GEMM feeds the all-reduce,
    the weight-gradient GEMM does not; the reorder runs the weight GEMM while the
    all-reduce is in flight, and never before its own input."""
    start, wait = torch.ops.boost.all_gather_start.default, torch.ops.boost.collective_wait.default
    nodes = [
        _Node("g"),  # the incoming gradient
        _Node("w_grad", deps=("g",)),  # weight-gradient GEMM: independent of the collective
        _Node("x_grad", deps=("g",)),  # input-gradient GEMM: the all-reduce's input
        _Node("start", start, ("x_grad",)),
        _Node("wait", wait, ("start",)),
        _Node("next", deps=("wait", "w_grad")),
    ]
    order = [n.name for n in reorder(nodes)]
    assert order == ["g", "x_grad", "start", "w_grad", "wait", "next"]
    # the all-reduce's in-place pair: the same order
    in_place = [torch.ops.boost.all_reduce_start_.default, torch.ops.boost.collective_wait_.default]
    nodes[3].node.op_overload, nodes[4].node.op_overload = in_place
    assert [n.name for n in reorder(nodes)] == order
    nodes[4].node.op_overload = torch.ops.boost.scatter_wait.default  # gloo's reduce-scatter
    assert [n.name for n in reorder(nodes)] == order
    no_wait = [n for n in nodes if n.name not in ("start", "wait")]
    assert reorder(no_wait) == no_wait  # nothing to overlap: Inductor's order stands
