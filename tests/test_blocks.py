"""Per-block compilation (option ``compile_blocks``): repeated blocks as nested compile regions.

Structure on the fake process group (the plan and the rewritten graphs, each block body
planned once per layout), and numbers on one device: Inductor's lowering of the region
bodies against eager. The 2-rank numbers are ``tests/test_tp.py``'s compiled checks,
which parallelize with the default ``compile_blocks=True``.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from rich.console import Console
from torch import nn

import boost_compiler
from boost_compiler.backend import boost_backend
from boost_compiler.ir.subgraphs import calls
from boost_compiler.models.cola_llama import build, example_inputs
from boost_compiler.parallel.blocks import mark, repeated_blocks
from boost_compiler.tp.groups import fake_process_group
from boost_compiler.tp.plan import TPPlan


def _parallelized(layers: int, blocks: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    model = build("tiny", n_layers=layers)
    mesh = init_device_mesh("cpu", (2,))
    (tokens,) = example_inputs(model.cfg)
    opts = {"compile_blocks": blocks}
    return boost_compiler.parallelize(model, mesh, (tokens,), {"labels": tokens}, options=opts)


def test_repeated_blocks_are_the_outermost_lists_of_one_class() -> None:
    model = build("tiny", n_layers=3)
    assert repeated_blocks(model) == ["layers.0", "layers.1", "layers.2"]
    mixed = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)]))
    assert repeated_blocks(mixed) == []
    nested = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)] * 2) for _ in range(2)])
    assert repeated_blocks(nested) == ["0", "1"]  # not "0.0", "0.1": they stay in "0"
    # one class holding different tensors: a later call's bias would be None where the
    # first call's was a tensor, which dynamo's reuse check cannot take
    no_bias = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2, bias=False)])
    assert repeated_blocks(no_bias) == []
    assert repeated_blocks(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 3)])) == []


class _Checkpointed(nn.Module):
    """The blocks inside one ``torch.utils.checkpoint`` region."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Stack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_blocks_inside_a_checkpoint_keep_the_whole_model_route(caplog: Any) -> None:
    """A region called from a checkpoint's body: torch 2.13's dynamo failed such a
    parallelized forward on one rank (a hang on the other), so parallelize keeps regions
    only where the top graph calls them."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _Checkpointed()
    assert repeated_blocks(model) == ["inner.layers.0", "inner.layers.1", "inner.layers.2"]
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
    with fake_process_group(2), caplog.at_level("INFO", logger="boost_compiler"):
        boost_compiler.parallelize(model, init_device_mesh("cpu", (2,)), (x,))
        shadow = boost_compiler.parallel_state(model).shadow
    assert "run inside another region" in caplog.text
    assert type(shadow.inner.layers[0]) is _Widening  # not a region
    route = model.boost_plan.route
    assert route.startswith("whole model: ") and "run inside another region" in route, route


def test_a_copy_owns_its_bodies_and_dropping_keeps_nested_ones() -> None:
    """``graph_copy`` copies the bodies a graph holds (passes inline into a copy's bodies
    and delete its submodules), and ``drop_unused_bodies`` keeps a body nested in a body
    it keeps (``delete_all_unused_submodules`` deleted it: found by the fuzzer)."""
    from boost_compiler.ir.subgraphs import drop_unused_bodies, graph_copy

    def module(graph: fx.Graph, **subs: nn.Module) -> fx.GraphModule:
        root = nn.Module()
        for name, sub in subs.items():
            root.add_module(name, sub)
        return fx.GraphModule(root, graph)

    inner_g = fx.Graph()
    inner_g.output(inner_g.placeholder("x"))
    outer_g = fx.Graph()
    outer_g.output((outer_g.placeholder("x"), outer_g.get_attr("inner")))
    top_g = fx.Graph()
    x = top_g.placeholder("x")
    top_g.get_attr("unused")
    top_g.output((x, top_g.get_attr("outer")))
    top = module(top_g, outer=module(outer_g, inner=module(inner_g)), unused=module(inner_g))
    copy_ = graph_copy(top)
    assert copy_.outer is not top.outer and copy_.outer.inner is not top.outer.inner
    drop_unused_bodies(copy_)
    assert not hasattr(copy_, "unused") and hasattr(top, "unused")
    assert hasattr(copy_.outer, "inner")
    delattr(copy_.outer, "inner")
    assert hasattr(top.outer, "inner")  # the original's body is untouched


def _regions(shadow: nn.Module) -> list[str]:
    """The shadow's modules marked as nested compile regions (by their class)."""
    return [n for n, m in shadow.named_modules() if getattr(type(m), "__boost_region__", False)]


def test_per_block_plan_equals_whole_model_plan() -> None:
    """Placements, bottlenecks and collectives (with their shapes) as one graph gives them.

    parallelize re-captures without regions whenever the placements differ, so the
    comparison alone would hold on the whole-model route too: the per-block route must
    have been kept (the shadow's layers are regions, and the plan says so)."""
    with fake_process_group(2):
        models = [_parallelized(3, True), _parallelized(3, False)]
        shadows = [boost_compiler.parallel_state(m).shadow for m in models]
        per_block, whole = (m.boost_plan for m in models)
    assert _regions(shadows[0]) == ["layers.0", "layers.1", "layers.2"]
    assert _regions(shadows[1]) == []
    assert per_block.route == "per-block (3 blocks)", per_block.route
    assert whole.route == "whole model: compile_blocks=False", whole.route
    assert per_block.params == whole.params
    assert len(per_block.bottlenecks) == len(whole.bottlenecks) == 21  # 7 per layer

    def key(plan: Any) -> Counter:
        return Counter((c.kind, c.forward, c.backward, tuple(c.global_shape))
                       for c in plan.collectives)  # fmt: skip

    assert key(per_block) == key(whole)
    assert per_block.fallbacks == whole.fallbacks == []
    # choices weighed per layer, each under its own module path (grouped: "layers.*")
    assert per_block.decisions == whole.decisions
    assert len(per_block.choices) == len(whole.choices) > 0


def test_user_classes_untouched_shadow_marked() -> None:
    with fake_process_group(2):
        model = _parallelized(2, True)
    block_cls = type(build("tiny").layers[0])
    assert type(model.layers[0]) is block_cls
    assert not hasattr(block_cls.forward, "__marked_compile_region_fn__")
    shadow = boost_compiler.parallel_state(model).shadow
    assert type(shadow.layers[0]) is not block_cls and isinstance(shadow.layers[0], block_cls)


class _Widening(nn.Module):
    """``x + up(silu(down(x)))``: placed like a residual block when the input is sharded."""

    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.nn.functional.silu(self.down(x)))


class _Stack(nn.Module):
    """Blocks whose first call gets a replicated input and the others a sharded one."""

    def __init__(self, d: int = 32, r: int = 8, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Widening(d, r) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_second_layout_gets_its_own_body() -> None:
    """The first block reads the replicated input, the others the sharded residual: two
    bodies, each under its own identifier (torch caches a body's compilation by it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from boost_compiler.options import BoostOptions
    from boost_compiler.passes import TP_REQUIRED, PassContext
    from boost_compiler.passes.driver import run_pipeline
    from boost_compiler.tp.groups import resolve_group

    graphs: list[fx.GraphModule] = []
    with fake_process_group(2):
        model = _Stack()
        mark(model, repeated_blocks(model))
        group = resolve_group(init_device_mesh("cpu", (2,)))

        def record(gm: fx.GraphModule, inputs: list) -> Any:
            graphs.append(gm)
            return gm.forward

        # (dynamo inlines a region none of whose activations needs a gradient)
        torch.compile(model, backend=record)(torch.randn(4, 32, requires_grad=True))
        torch._dynamo.reset()
        gm = graphs[0]
        params = {n.name: n.name for n in gm.graph.nodes
                  if n.op == "placeholder" and "parameters" in n.name}  # fmt: skip
        ctx = PassContext(params, tp=group)
        run_pipeline(gm, ctx, BoostOptions.parse({}), required=TP_REQUIRED)
    found = calls(gm.graph)
    assert len(found) == 3
    idents = [c.args[1] for c in found]
    assert idents[1] == idents[2] != idents[0]
    bodies = {c.args[0].target for c in found}
    assert len(bodies) == 2
    assert ctx.notes["btp"].fallbacks == []


@pytest.mark.timeout(300)
def test_region_bodies_lowered_exactly_on_one_device() -> None:
    """Inductor's lowering of reused block bodies against eager, gradients included.

    torch 2.13 let a body reuse its incoming gradient's buffer, and every call but the
    last got wrong weight gradients (10% on the norm weights); the backend lowers graphs
    with regions without buffer reuse.
    """
    torch._dynamo.reset()
    model = build("tiny", n_layers=2)
    ref = copy.deepcopy(model)
    mark(model, repeated_blocks(model))
    (tokens,) = example_inputs(model.cfg)
    loss = torch.compile(model, backend="boost")(tokens, labels=tokens)
    loss.backward()
    ref_loss = ref(tokens, labels=tokens)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert err <= 1e-5, (name, err)
    torch._dynamo.reset()


def test_a_block_input_written_after_the_call_keeps_its_gradient() -> None:
    """``z += block(z)`` and friends, each block a region, lowered by Inductor on one device.

    torch 2.13 wrote a pointwise result in place into a body's input that its backward
    still read (63% off on a down factor's weight gradient); graphs with regions lower
    without in-place buffers.
    """
    from tests.mutation_checks import MODELS, _inputs

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["AllPatterns"]()
    ref = copy.deepcopy(model)
    ref.reference = True  # z = z + block(z): what eager autograd allows
    mark(model, repeated_blocks(model))
    (x,) = _inputs()
    out = torch.compile(model, backend="boost")(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights).sum().backward()
    (ref(x) * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert err <= 1e-5, (name, err)
    torch._dynamo.reset()


def test_a_bottleneck_across_blocks_keeps_the_whole_model_route() -> None:
    """Dense MLPs: the down projection narrows to the hidden and the next block's gate
    widens it, a pair found across the residual that no block's body sees alone; planned
    per block, the MLPs would stay whole. parallelize compiles such a model as one graph."""
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.hybrid_mlp import make_hybrid
    from boost_compiler.bench.harness import ModelSpec

    spec = ModelSpec(d=64, ff=176, rank=16, layers=2, heads=4, vocab=256, seq=16)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    plans, shadows = [], []
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        for blocks in (True, False):
            model = make_hybrid(spec)
            opts = {"compile_blocks": blocks}
            boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}, options=opts)
            plans.append(model.boost_plan)
            shadows.append(boost_compiler.parallel_state(model).shadow)
    assert plans[0].params == plans[1].params
    assert str(plans[0].params["layers.1.mlp.gate_proj.weight"]) == "S(0)"
    assert plans[0].decisions == plans[1].decisions
    assert type(shadows[0].layers[0]) is type(shadows[1].layers[0])  # not a region
    route = plans[0].route  # the fallback, and why, in the plan (not only in a log line)
    assert route.startswith("whole model: planned whole it places"), route
    assert "per block" in route and ".mlp." in route, route


# HF decoders as users load them (tiny configs, CoLA-converted): family -> how the model is
# built and the names of its decoder layers.
HF_BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "qwen3": "model.layers"}


def _hf_model(family: str) -> tuple[nn.Module, torch.Tensor]:
    from tests import zoo_checks
    from tests.models import make_hf

    if family == "qwen3":
        ids = torch.randint(0, zoo_checks.VOCAB, (2, 16),
                            generator=torch.Generator().manual_seed(1))  # fmt: skip
        return zoo_checks.build(family), ids
    model, (ids,) = make_hf(0, family)
    return model, ids


@pytest.mark.parametrize("family", HF_BLOCKS)
def test_transformers_models_compile_block_by_block(family: str, monkeypatch: Any) -> None:
    """GPT-2, Llama and Qwen3 as transformers builds them keep the per-block route: the
    shadow's decoder layers are regions, and the graphs the boost backend receives at the
    first call call one region per layer (any capture error with regions would fall back
    to the whole model, which only the plan's ``route`` and these calls show)."""
    from tests.extras import need

    need("transformers")
    from boost_compiler.parallel import parallelize as parallel

    received: list[int] = []  # region calls in each graph the backend was given

    def recording(gm: fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        received.append(len(calls(gm.graph)))  # counted before the backend rewrites it
        return boost_backend(gm, inputs, **kw)

    monkeypatch.setattr(parallel, "boost_backend", recording)
    model, ids = _hf_model(family)
    layers = model.config.num_hidden_layers
    kw = {"labels": ids, "use_cache": False}
    torch._dynamo.reset()
    with fake_process_group(2):
        boost_compiler.parallelize(model, dist.group.WORLD, (ids,), kw)
        shadow = boost_compiler.parallel_state(model).shadow
        model(ids, **kw)
    torch._dynamo.reset()
    assert _regions(shadow) == [f"{HF_BLOCKS[family]}.{i}" for i in range(layers)]
    # one call per layer, all in one graph (GPT-2's forward gives a second graph, past a
    # graph break, with none)
    assert max(received) == sum(received) == layers, received
    plan = model.boost_plan
    assert plan.route == f"per-block ({layers} blocks)", plan.route
    assert plan.fallbacks == [], plan.fallbacks
    # the route is saved with the plan, and shown where the plan is printed
    assert TPPlan.from_json(plan.to_json()).route == plan.route
    console = Console(width=200, record=True)
    console.print(plan)
    assert f"compiled: per-block ({layers} blocks)" in console.export_text()
