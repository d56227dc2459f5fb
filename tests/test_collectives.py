"""Tensor-parallel primitives: values, gradients and graph structure.

``test_two_ranks_gloo`` spawns one 2-rank gloo group (CPU) and checks every
primitive eagerly, inside ``torch.compile(backend="inductor")``, and inserted as
call_function nodes into a dynamo graph that is then run eagerly or lowered with
``compile_fx`` (the compiler's own path). ``test_graph_structure_fake_pg`` uses
the single-process fake group to assert, per primitive, which collectives the
AOT forward and backward graphs contain.
"""

from __future__ import annotations

import os
import re
import socket
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp

from boost_compiler.tp import collectives as C

WORLD = 2
SHAPE = (4, 6)
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "inductor"

# g = reduce_from_tp, f = copy_to_tp, ar = all_reduce_sum, gather/scatter = *_tp along dim 1,
# rs = reduce_scatter_to_tp, gsum = gather_sum_grad (a gather whose gradient is reduce-scattered)
PRIMS = ("g", "f", "ar", "gather", "scatter", "rs", "gsum")


def _call(name: str, x: torch.Tensor, group: str, dim: int = 1) -> torch.Tensor:
    if name == "g":
        return C.reduce_from_tp(x, group)
    if name == "f":
        return C.copy_to_tp(x, group)
    if name == "ar":
        return C.all_reduce_sum(x, group)
    if name == "gather":
        return C.gather_from_tp(x, dim, group)
    if name == "rs":
        return C.reduce_scatter_to_tp(x, dim, group)
    if name == "gsum":
        return C.gather_sum_grad(x, dim, group)
    return C.scatter_to_tp(x, dim, group)


# ----------------------------------------------------------------------------
# inputs and the math every rank can compute for all ranks
# ----------------------------------------------------------------------------


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _input(name: str, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s input: rank-varying for g/ar/gather/rs/gsum, replicated for f/scatter."""
    if name == "g":
        return _randn(1, *SHAPE) * (rank + 1)
    if name == "f":
        return _randn(2, *SHAPE)
    if name == "ar":
        return _randn(3, *SHAPE) + rank
    if name in ("gather", "gsum"):
        shape = list(SHAPE)
        shape[dim] //= WORLD
        return _randn(4 if name == "gather" else 7, *shape) * (rank + 1)
    if name == "rs":
        return _randn(8, *SHAPE) - rank
    return _randn(5, *SHAPE)


def _weight(name: str, rank: int, out_shape: torch.Size) -> torch.Tensor:
    """Loss weight: the same on all ranks where the consumer is replicated (g, gather),
    rank-varying where it is rank-varying (f, ar, scatter)."""
    w = _randn(6, *out_shape)
    return w if name in ("g", "gather") else w * (rank + 1)


def _expected(name: str, rank: int, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward value, input gradient) on ``rank`` for per-rank loss
    ``L_r = sum(w_r * sin(prim(x_r)))``, the total loss being ``sum_r L_r`` for
    rank-varying consumers and the (replicated) ``L`` itself otherwise."""
    xs = [_input(name, r, dim) for r in range(WORLD)]
    if name in ("g", "ar"):
        ys = [sum(xs)] * WORLD
    elif name == "f":
        ys = xs
    elif name in ("gather", "gsum"):
        ys = [torch.cat(xs, dim)] * WORLD
    elif name == "rs":
        ys = list(sum(xs).chunk(WORLD, dim))
    else:
        ys = [x.chunk(WORLD, dim)[r] for r, x in enumerate(xs)]
    gs = [_weight(name, r, ys[r].shape) * ys[r].cos() for r in range(WORLD)]  # dL_r/dy_r
    if name == "g":
        grad = gs[rank]
    elif name in ("f", "ar"):
        grad = sum(gs)
    elif name == "gather":
        grad = gs[rank].chunk(WORLD, dim)[rank]
    elif name == "gsum":  # rank-varying consumers: the sum of their gradients, this block
        grad = sum(gs).chunk(WORLD, dim)[rank]
    else:  # scatter, rs: every shard's gradient reaches every rank's input
        grad = torch.cat(gs, dim)
    return ys[rank].sin(), grad


# ----------------------------------------------------------------------------
# the functions under test
# ----------------------------------------------------------------------------


def _all_prims(group: str):
    def fn(xg, xf, xa, xgat, xsc, xrs, xgs):
        xs = (xg, xf, xa, xgat, xsc, xrs, xgs)
        return tuple(_call(n, x, group).sin() for n, x in zip(PRIMS, xs, strict=True))

    return fn


class _Sines(torch.nn.Module):
    """Independent ``sin``s, one per primitive; the insertion backend puts it before each."""

    def forward(self, xg, xf, xa, xgat, xsc, xrs, xgs):
        return xg.sin(), xf.sin(), xa.sin(), xgat.sin(), xsc.sin(), xrs.sin(), xgs.sin()


def _insert_primitives(gm: fx.GraphModule, group: str) -> None:
    """What the compiler does: insert call_function nodes into the dynamo graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(PRIMS)
    fns = {
        "g": (C.reduce_from_tp, ()),
        "f": (C.copy_to_tp, ()),
        "ar": (C.all_reduce_sum, ()),
        "gather": (C.gather_from_tp, (1,)),
        "scatter": (C.scatter_to_tp, (1,)),
        "rs": (C.reduce_scatter_to_tp, (1,)),
        "gsum": (C.gather_sum_grad, (1,)),
    }
    for name, ph in zip(PRIMS, placeholders, strict=True):
        fn, extra = fns[name]
        users = list(ph.users)
        with gm.graph.inserting_after(ph):
            node = gm.graph.call_function(fn, (ph, *extra, group))
        for user in users:
            user.replace_input_with(ph, node)
        example = ph.meta.get("example_value")
        if example is not None:  # dynamo graph: keep meta complete for AOT's cache check
            with example.fake_mode:
                node.meta["example_value"] = fn(example, *extra, group)
        if extra:  # as the propagator does: the rank in
            node.kwargs = {"rank": dist.get_rank(), "world_size": WORLD}  # the graph's text
    gm.graph.lint()
    gm.recompile()


def _inserting_backend(group: str, lower: bool):
    def backend(gm: fx.GraphModule, example_inputs):
        _insert_primitives(gm, group)
        if not lower:
            return gm.forward  # eager execution of the rewritten GraphModule
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    return backend


def _count_collectives(code: str) -> Counter:
    ops = re.findall(r"_c10d_functional\.(\w+?)_?\.default\(", code)
    return Counter(op for op in ops if op != "wait_tensor")


# ----------------------------------------------------------------------------
# two-rank worker
# ----------------------------------------------------------------------------


def _check_run(tag: str, fn, rank: int, failures: list[str]) -> list[str]:
    """Run ``fn`` forward and backward on this rank's inputs; compare to the math.
    Returns the Inductor output code produced meanwhile (empty when not compiled)."""
    from torch._inductor.utils import run_and_get_code

    xs = [_input(n, rank).requires_grad_() for n in PRIMS]

    def step():
        outs = fn(*xs)
        loss = sum((_weight(n, rank, y.shape) * y).sum() for n, y in zip(PRIMS, outs, strict=True))
        loss.backward()
        return outs

    outs, codes = run_and_get_code(step)
    for name, x, y in zip(PRIMS, xs, outs, strict=True):
        want_y, want_grad = _expected(name, rank)
        for what, got, want in (("forward", y, want_y), ("grad", x.grad, want_grad)):
            try:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            except AssertionError as e:
                failures.append(f"rank {rank} {tag} {name} {what}: {e}")
    return codes


def _worker(rank: int, port: int, result_dir: str) -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
    torch.set_num_threads(1)
    failures: list[str] = []
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        group = C.group_name_of(dist.group.WORLD)

        # eager, including gather/scatter along dims 0, 1 and -1
        _check_run("eager", _all_prims(group), rank, failures)
        for dim in (0, -1):
            for name in ("gather", "scatter", "rs", "gsum"):
                x = _input(name, rank, dim).requires_grad_()
                y = _call(name, x, group, dim)
                (_weight(name, rank, y.shape) * y.sin()).sum().backward()
                want_y, want_grad = _expected(name, rank, dim)
                try:
                    torch.testing.assert_close(y.sin(), want_y)
                    torch.testing.assert_close(x.grad, want_grad)
                except AssertionError as e:
                    failures.append(f"rank {rank} eager {name} dim={dim}: {e}")

        # DeviceMesh -> group name
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        if C.group_name_of(mesh) != mesh._dim_group_names[0]:
            failures.append(f"rank {rank} mesh group name {C.group_name_of(mesh)}")

        # forward: g, ar; gather, gsum; rs. backward: f, ar; scatter, rs; gsum
        expect_fwd = Counter(
            {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
        )
        expect_bwd = Counter(
            {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
        )
        runs = (
            ("torch.compile", torch.compile(_all_prims(group), backend="inductor")),
            ("fx-insert eager", torch.compile(_Sines(), backend=_inserting_backend(group, False))),
            (
                "fx-insert compile_fx",
                torch.compile(_Sines(), backend=_inserting_backend(group, True)),
            ),
        )
        for tag, fn in runs:
            codes = _check_run(tag, fn, rank, failures)
            if tag == "fx-insert eager":
                continue
            counts = [_count_collectives(c) for c in codes]
            if counts != [expect_fwd, expect_bwd]:
                failures.append(f"rank {rank} {tag}: collectives in fwd/bwd code {counts}")
    except Exception:
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
        Path(result_dir, f"rank{rank}.txt").write_text("\n".join(failures))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gloo(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    failures = [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(WORLD)]
    assert not any(failures), "\n".join(f for f in failures if f)


# ----------------------------------------------------------------------------
# single process: graph structure per primitive (fake process group)
# ----------------------------------------------------------------------------

# (forward, backward) collectives in the graphs AOTAutograd hands to Inductor
STRUCTURE = {
    "g": ({"all_reduce": 1}, {}),
    "f": ({}, {"all_reduce": 1}),
    "ar": ({"all_reduce": 1}, {"all_reduce": 1}),
    "gather": ({"all_gather_into_tensor": 1}, {}),
    "scatter": ({}, {"all_gather_into_tensor": 1}),
    "rs": ({"reduce_scatter_tensor": 1}, {"all_gather_into_tensor": 1}),
    "gsum": ({"all_gather_into_tensor": 1}, {"reduce_scatter_tensor": 1}),
}


def _aot_graphs(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> dict[str, fx.GraphModule]:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: dict[str, fx.GraphModule] = {}

    def recorder(tag):
        def compiler(g, _inputs):
            graphs[tag] = g
            return make_boxed_func(g.forward)

        return compiler

    compiled = aot_module_simplified(gm, inputs, recorder("fw"), recorder("bw"))
    compiled(*inputs)[0].sum().backward()
    return graphs


def _collectives_in(gm: fx.GraphModule) -> Counter:
    counts: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        assert not isinstance(n.target, torch._ops.HigherOrderOperator), n.format_node()
        assert "boost" not in str(n.target), n.format_node()  # nothing opaque left
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "_c10d_functional":
            if n.target._opname != "wait_tensor":
                counts[n.target._opname] += 1
    return counts


@pytest.mark.parametrize("name", PRIMS)
def test_graph_structure_fake_pg(name):
    with C.fake_process_group(WORLD) as group:
        gm = fx.symbolic_trace(_Sines())
        _insert_primitives(gm, group)
        inputs = [_input(n, 0).requires_grad_() for n in PRIMS]
        # keep only the primitive under test: the graph outputs its branch alone
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = ((out.args[0][PRIMS.index(name)],),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        graphs = _aot_graphs(gm, inputs)
        fwd, bwd = STRUCTURE[name]
        assert _collectives_in(graphs["fw"]) == Counter(fwd)
        assert _collectives_in(graphs["bw"]) == Counter(bwd)
    assert not dist.is_initialized()


def test_group_names_fake_pg():
    from torch.distributed.device_mesh import init_device_mesh

    with C.fake_process_group(4) as group:
        assert group == dist.group.WORLD.group_name == C.group_name_of(None)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
        assert C.group_name_of(tp) == tp.get_group().group_name == mesh._dim_group_names[1]
        assert C.group_name_of(mesh.get_group("tp")) == C.group_name_of(tp)
        with pytest.raises(ValueError):
            C.group_name_of(mesh)
        with pytest.raises(RuntimeError):
            with C.fake_process_group(2):
                pass
    assert not dist.is_initialized()


def test_marked_nodes_carry_the_rank():
    """AOTAutograd's cache key is the graph text, identical on all ranks unless the
    rank-dependent primitives carry their rank (a warm cache once mixed ranks up)."""
    codes = []
    for rank in range(WORLD):
        with C.fake_process_group(WORLD, rank=rank) as group:
            gm = fx.symbolic_trace(_Sines())
            _insert_primitives(gm, group)
            codes.append(gm.code)
            x = torch.randn(4, 6)
            with pytest.raises(ValueError, match="built for rank"):
                C.scatter_to_tp(x, 1, group, rank=1 - rank, world_size=WORLD)
    assert codes[0] != codes[1]
    assert f"rank = 1, world_size = {WORLD}" in codes[1]
