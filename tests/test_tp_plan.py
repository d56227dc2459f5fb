"""parallelize() in one process on torch's fake process group: plan structure, bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import boost_compiler
from boost_compiler.tp.collectives import fake_process_group
from examples.cola_llama import build, example_inputs
from tests.tp_harness import ops_run


def _plan(world: int, options: dict | None = None, **overrides):
    with fake_process_group(world):
        model = build("tiny", **overrides)
        ids = example_inputs(model.cfg, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, ids, options=options)
        return model, model.boost_plan


def _run_collectives(
    world: int, options: dict | None = None
) -> tuple[object, list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
    """The functional collectives a parallelized model's forward and backward execute.

    Counted on what runs (profiler events of the eager path, the boost backend's own
    pipeline on the shadow graph), after one warm-up step that compiles.
    """
    with fake_process_group(world):
        model = build("tiny")
        ids = example_inputs(model.cfg, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, ids, options=options)
        model(*ids).sum().backward()  # compiles
        loss, fwd = ops_run(lambda: model(*ids).sum())
        _, bwd = ops_run(loss.backward)
    shapes = [[(k, tuple(s)) for k, s, _ in ev] for ev in (fwd, bwd)]
    return model.cfg, *shapes


def test_collectives_sit_on_the_rank_dim() -> None:
    """Default passes: per layer 4 forward all-reduces (3r+stats, r, 2r+stats, r), 4 backward,
    as the forward and backward execute them."""
    cfg, fwd, bwd = _run_collectives(2)
    b, s, r, d, layers = 2, 16, cfg.rank, cfg.d_model, cfg.n_layers
    assert sorted(p for k, p in fwd if k == "all_reduce") == sorted(
        [(b, s, 3 * r + 1), (b, s, r), (b, s, 2 * r + 1), (b, s, r)] * layers + [(b, s, 1)]
    )  # the last: the final norm, which feeds the LM head's gather, not a down factor
    assert sorted(p for k, p in bwd if k == "all_reduce") == sorted(
        [(b, s, 3 * r), (b, s, r), (b, s, 2 * r), (b, s, r)] * layers + [(b, s, 1)]
    )
    assert not [c for c in fwd + bwd if c[1][-1] == d]  # no hidden-size all-reduce
    gathers = [c for c in fwd if c[0].startswith("all_gather")]
    assert len(gathers) == 1 and math.prod(gathers[0][1]) == b * s * d // 2  # the LM head's
    assert not [c for c in bwd if c[0].startswith("all_gather")]
    assert {k for k, _ in fwd + bwd} <= {"all_reduce", "all_gather_into_tensor"}


def test_btp_alone_has_one_collective_per_factor() -> None:
    """With grouping and online norm off, the plain BTP structure (what they improve on),
    counted on what runs."""
    off = {"group_linears": False, "online_norm": False}
    cfg, fwd, bwd = _run_collectives(2, off)
    b, s, r, layers = 2, 16, cfg.rank, cfg.n_layers
    fwd = [p for k, p in fwd if k == "all_reduce"]
    assert fwd.count((b, s, r)) == 7 * layers  # one per down factor
    assert fwd.count((b, s, 1)) == 2 * layers + 1  # a statistics all-reduce per norm
    assert len(fwd) == 9 * layers + 1
    bwd = [p for k, p in bwd if k == "all_reduce"]
    assert bwd.count((b, s, r)) == 7 * layers and len(bwd) == 9 * layers + 1


def test_placements_follow_the_bottlenecks() -> None:
    _, plan = _plan(2)
    p = plan.params
    assert str(p["layers.0.attn.q_proj.down.weight"]) == "S(1)"  # row-parallel on d_in
    assert str(p["layers.0.attn.q_proj.up.weight"]) == "S(0)"  # column-parallel on d_out
    assert str(p["layers.0.attn_norm.weight"]) == "S(0)"
    assert str(p["embed.weight"]) == "S(1)"  # hidden-dim split
    assert str(p["lm_head.weight"]) == "R"


def test_heads_not_divisible_raise_before_any_change() -> None:
    with fake_process_group(8):
        model = build("tiny")  # 4 heads
        before = {n: prm for n, prm in model.named_parameters()}
        with pytest.raises(boost_compiler.errors.ShardingError, match=r"p=8") as err:
            boost_compiler.parallelize(model, dist.group.WORLD, example_inputs(model.cfg))
        assert "attn" in str(err.value) or "dimension" in str(err.value)
        assert all(prm is before[n] for n, prm in model.named_parameters())


def test_hidden_not_divisible_names_parameter() -> None:
    with fake_process_group(3):
        model = build("tiny")  # d = 64
        with pytest.raises(
            boost_compiler.errors.ShardingError, match=r"'embed.weight'.*size 64.*p=3"
        ):
            boost_compiler.parallelize(model, dist.group.WORLD, example_inputs(model.cfg))


def test_two_dimensional_mesh_is_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build("tiny")
        with pytest.raises(boost_compiler.errors.MeshError, match="1-D.*mesh\\['tp'\\]"):
            boost_compiler.parallelize(model, mesh, example_inputs(model.cfg))


def test_example_inputs_that_do_not_run() -> None:
    with fake_process_group(2):
        model = build("tiny")
        bad = (torch.randn(2, 16),)  # floats where token ids are expected
        with pytest.raises(boost_compiler.errors.CaptureError, match="did not run"):
            boost_compiler.parallelize(model, dist.group.WORLD, bad)


_AR = {
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_reduce_.default,
}
_AG = {torch.ops._c10d_functional.all_gather_into_tensor.default}
_RS = {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _collectives_of(gm: torch.fx.GraphModule) -> list[tuple[str, tuple[int, ...]]]:
    """The collectives one run of ``gm`` issues: a region call's body's, once per call."""
    found = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.invoke_subgraph:
            found += _collectives_of(getattr(gm, node.args[0].target))
            continue
        kind = (
            "all_reduce" if node.target in _AR
            else "all_gather" if node.target in _AG
            else "reduce_scatter" if node.target in _RS
            else ""
        )  # fmt: skip
        if kind:
            found.append((kind, tuple(node.args[0].meta["val"].shape)))
    return found


def test_inductor_graphs_hold_exactly_the_planned_collectives() -> None:
    """What Inductor lowers (post-grad fwd and bwd graphs) carries the rank-dim collectives."""
    graphs: list[list[tuple[str, tuple[int, ...]]]] = []
    with fake_process_group(2):
        model = build("tiny")
        cfg = model.cfg
        (ids,) = example_inputs(cfg, batch=2, seq=16)
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
        seen: list[torch.fx.GraphModule] = []
        record = {"post_grad_custom_pre_pass": lambda g: seen.append(g.owning_module)}
        # Blocking waits: torch's collectives as they are (the split into polled starts and
        # waits runs on a body before its caller's pre-pass: tests/test_poll_waits.py).
        options = {"inductor_config": record, "collective_wait": "block"}
        run = torch.compile(model, backend="boost", options=options)
        run(ids, labels=ids).backward()
        # Inductor passes the decoder block's body (a region: compile_blocks) and then the
        # graph calling it; what runs is the caller's collectives with the body's per call.
        bodies = {id(sub) for g in seen for sub in g.children()}
        graphs = [_collectives_of(g) for g in seen if id(g) not in bodies]
    assert len(graphs) == 2, "expected one forward and one backward graph"
    fwd, bwd = graphs
    b, s, r, d, layers = 2, 16, cfg.rank, cfg.d_model, cfg.n_layers
    per_layer_fwd = [(b, s, 3 * r + 1), (b, s, r), (b, s, 2 * r + 1), (b, s, r)]
    per_layer_bwd = [(b, s, 3 * r), (b, s, r), (b, s, 2 * r), (b, s, r)]
    # + the final norm's statistics (it feeds the LM head's gather, not a down factor),
    # and the vocabulary-parallel loss: one all-gather of every rank's [log-sum-exp, target
    # term] per token (the input of each: this rank's [tokens, 2]; the labels are shifted,
    # so every position is there); backward: the head input's gradient (each rank holds
    # part of the vocabulary), reduce-scattered onto the hidden shards (d-major: the
    # scatter splits dim 0).
    tokens = b * s
    assert sorted(p for k, p in fwd if k == "all_reduce") == sorted(
        per_layer_fwd * layers + [(b, s, 1)]
    )
    assert sorted(p for k, p in bwd if k == "all_reduce") == sorted(
        per_layer_bwd * layers + [(b, s, 1)]
    )
    assert [c for c in fwd if c[0] == "all_gather"] == [
        ("all_gather", (b, s, d // 2)),
        ("all_gather", (tokens, 2)),
    ]
    assert not [c for c in bwd if c[0] == "all_gather"]
    assert [c for c in bwd if c[0] == "reduce_scatter"] == [("reduce_scatter", (d, b, s))]
    assert not [c for c in fwd if c[0] == "reduce_scatter"]
    # No tensor on a rank is wider than V/p in the vocabulary: the full logits exist nowhere.
    assert all(shape[-1] != cfg.vocab_size for _, shape in fwd + bwd)


class _BreakingBlock(torch.nn.Module):
    """A bottleneck whose forward graph-breaks: dynamo resumes the rest in a new frame."""

    def __init__(self, d: int = 16, r: int = 4) -> None:
        super().__init__()
        self.down = torch.nn.Linear(d, r, bias=False)
        self.up = torch.nn.Linear(r, d, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(torch.relu(self.down(x)))
        torch._dynamo.graph_break()
        return (x + h * self.scale).sum()


def test_frames_past_the_recompile_limit_raise_instead_of_running_placeholders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame dynamo gives up on would run the shadow's NaN placeholders: it must raise.

    A graph break splits the model into frames. The parallelized forward raises
    the recompile limit to ``SHADOW_RECOMPILE_LIMIT`` for its frames (a user's
    ``recompile_limit=1`` still runs it compiled); past even that (lowered here to
    1), the frames captured once by ``parallelize``'s analysis are at their limit
    when the user's compile enters them, and the forward raises
    ``UncompiledFrameError``. The process-wide flag is untouched before, during
    setup and after (it is set only while the parallelized forward runs), so a
    plain model past the same limit still runs as dynamo's default says. Calling
    the shadow's compiled entry without the forward's flag runs the frame as
    Python, where the placeholders themselves raise (they gave NaN before).
    """
    from boost_compiler.parallel import shadow

    torch._dynamo.reset()
    x = torch.randn(2, 3, 16)
    previous = torch._dynamo.config.fail_on_recompile_limit_hit
    reference = _BreakingBlock()
    try:
        with fake_process_group(2):
            model = copy.deepcopy(reference)
            boost_compiler.parallelize(model, dist.group.WORLD, (x,))  # a plan across a break
            assert torch._dynamo.config.fail_on_recompile_limit_hit is previous  # no leak
            run = torch.compile(model, backend="boost", options={"lowering": "eager"})
            with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):
                assert torch.isfinite(run(x))  # compiled, not placeholders (fake group: no values)
                torch._dynamo.reset()
                monkeypatch.setattr(shadow, "SHADOW_RECOMPILE_LIMIT", 1)
                with pytest.raises(
                    boost_compiler.errors.UncompiledFrameError, match="recompile limit"
                ):
                    model(x)  # parallelize's own capture holds the frames' one entry
                    run(x)
                assert torch._dynamo.config.fail_on_recompile_limit_hit is False
                plain = torch.compile(
                    _BreakingBlock(), backend="boost", options={"lowering": "eager"}
                )
                for size in (3, 4, 5):  # past the limit: dynamo runs it uncompiled
                    assert torch.isfinite(plain(torch.randn(2, size, 16)))
                unguarded = torch.compile(model.forward._enter, backend="boost",
                                          options={"lowering": "eager"})  # fmt: skip
                # past the limit without the forward's flag: the frame runs as Python, and
                # the placeholders themselves refuse to compute (they gave NaN before)
                with pytest.raises(boost_compiler.errors.UncompiledFrameError, match="placeholder"):
                    unguarded(x)
        assert torch._dynamo.config.fail_on_recompile_limit_hit is previous
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit = previous
        torch._dynamo.reset()


@pytest.mark.parametrize("labels", [False, True])
def test_plan_reports_per_rank_bytes_and_what_stays_whole(labels: bool) -> None:
    """Per-rank parameter/gradient/AdamW bytes read off the local tensors, and the plan's
    replicated list, the same set; with the loss in the graph nothing large stays whole."""
    with fake_process_group(2):
        model = build("tiny", vocab_size=512)
        ids = example_inputs(model.cfg, seq=16)
        kwargs = {"labels": ids[0]} if labels else None
        boost_compiler.parallelize(model, dist.group.WORLD, ids, kwargs)
        plan = model.boost_plan
        mem = plan.rank_memory()
        local = {n: p for n, p in model.named_parameters()}
        held = {n for n, p in local.items() if p.shape == plan.param_shapes[n]}
        assert set(mem.replicated) == held, (mem.replicated, held)
        nbytes = sum(p.numel() * p.element_size() for p in local.values())
        assert mem.params == nbytes and mem.grads == nbytes and mem.adamw == 2 * nbytes
        text = plan.memory_text()  # what rich.print(plan) shows
        assert all(name in text for name in mem.replicated) and f"{mem.params:,} B" in text
    big = {n: k for n, k in mem.replicated.items() if k > 4096}
    # logits out of the graph: the head is replicated (gathering [b, s, V] logits costs
    # more than the head on CPU); with the loss in the graph, it is split on V
    assert big == ({} if labels else {"lm_head.weight": 512 * model.cfg.d_model}), big
