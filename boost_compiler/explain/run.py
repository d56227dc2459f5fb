"""Running capture, detection and the pass pipeline on a simulated group, stage by stage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck
from ..costmodel import LlamaDims, cost, plan_comm
from ..errors import BoostError
from ..ir.capture import capture
from ..ir.dump import GraphDumper
from ..ir.ops import value_of
from ..options import BoostOptions
from ..passes import PIPELINE, PassContext
from ..tp.parallel import TPGroup, resolve_group
from ..tp.placement import R
from ..tp.plan import TPPlan
from ..tp.propagate import Collective, ShardingPropagator
from . import draw
from .report import CollectiveRow, CostRow, Report, Stage

log = get_logger(__name__)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@contextlib.contextmanager
def simulated_group(tp: int) -> Iterator[TPGroup]:
    """A ``tp``-rank group in this process: torch's fake process group, or (when a real
    default group exists already) a named stand-in; the passes only read name/size/rank."""
    from ..tp.collectives import fake_process_group

    if dist.is_available() and dist.is_initialized():
        log.info("explain: a process group exists; simulating tp=%d by name only", tp)
        yield TPGroup(f"explain_tp{tp}", tp, 0)
        return
    with fake_process_group(tp):
        yield resolve_group(dist.group.WORLD)


@contextlib.contextmanager
def record_placements() -> Iterator[None]:
    """Leave each node's placement in ``node.meta["boost_placement"]`` after propagation."""
    original = ShardingPropagator.run

    def run(self: ShardingPropagator) -> Any:
        result = original(self)
        for node, pl in self.env.items():
            node.meta.setdefault(draw.PLACEMENT_META, pl)
        return result

    ShardingPropagator.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator.run = original  # type: ignore[method-assign]


def _recorded(ctx: PassContext) -> list[Collective] | None:
    """The collectives the passes keep in ``ctx.notes`` (None: no pass records any)."""
    found: list[Collective] | None = None
    for note in ctx.notes.values():
        colls = getattr(note, "collectives", None)
        if isinstance(colls, list):
            found = (found or []) + [c for c in colls if isinstance(c, Collective)]
    return found


def _standard_estimate(gm: fx.GraphModule, bottlenecks: Sequence[Bottleneck]) -> CostRow | None:
    """Megatron's plan on the same factor pairs: all-reduce ``[tokens, d_out]`` forward per
    pair, ``[tokens, d_in]`` backward per distinct input (fused column layers)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    fwd = bwd = 0
    inputs: set[Any] = set()
    for b in bottlenecks:
        down = nodes.get(b.down_node)
        v = value_of(down)
        if not isinstance(v, torch.Tensor):
            return None
        tokens, e = v.numel() // b.rank, v.dtype.itemsize
        fwd += tokens * b.d_out * e
        src = down.args[0] if down is not None and down.args else None
        if src not in inputs:
            inputs.add(src)
            bwd += tokens * b.d_in * e
    return CostRow(
        f"standard low-rank TP, same {len(bottlenecks)} bottlenecks", fwd, bwd,
        len(bottlenecks), len(inputs), "estimate: factor pairs only, no norms / head",
    )  # fmt: skip


def _formula_rows(model: nn.Module, example_inputs: Sequence[Any], tp: int) -> list[CostRow]:
    """The cost model's per-step totals when the model carries LLaMA dims (``model.cfg``)."""
    cfg = getattr(model, "cfg", None)
    ids = next((x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() == 2), None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if cfg is None or ids is None or _DTYPE_NAMES.get(dtype) is None:  # type: ignore[arg-type]
        return []
    try:
        dims = LlamaDims.from_model_config(cfg, type(model).__name__)
        report = cost(dims, tp, int(ids.shape[0]), int(ids.shape[1]), _DTYPE_NAMES[dtype])  # type: ignore[index]
    except (AttributeError, TypeError, BoostError, ValueError) as err:
        log.info("explain: no cost-model formula for this model (%s)", err)
        return []
    L = dims.n_layers
    return [
        CostRow(
            f"formula: {c.title}",
            c.forward.total_bytes * L,
            c.backward.total_bytes * L,
            c.forward.collectives * L,
            c.backward.collectives * L,
            f"costmodel.cost × {L} layers",
        )  # fmt: skip
        for c in report.strategies.values()
    ]


def explain(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    tp: int = 2,
    out_dir: str | Path | None = "boost-report",
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    layer: str | None = None,
) -> Report:
    """Explain what boost does to ``model`` at tensor-parallel degree ``tp``.

    Nothing runs on real ranks and the model is not modified. ``options`` are the
    backend's (e.g. ``{"group_linears": False}`` to see the plan without that pass);
    ``layer`` picks the drawn layer (default: the first of the largest layers);
    ``out_dir=None`` writes no files. Example::

        import rich
        from boost_compiler.explain import explain
        from examples.factories import cola_llama_tiny

        model, inputs, kwargs = cola_llama_tiny()   # (model, example inputs, example kwargs)
        report = explain(model, inputs, tp=2, out_dir="boost-report", example_kwargs=kwargs)
        rich.print(report)   # then open boost-report/report.html
    """
    t0 = time.perf_counter()
    opts = BoostOptions.parse(options)
    graphs = capture(model, tuple(example_inputs), example_kwargs)
    main = max(range(len(graphs)), key=lambda i: len(graphs[i].gm.graph.nodes))
    plan = TPPlan(p=tp, group="")
    stages: dict[str, Stage] = {}
    errors: list[str] = []
    standard: CostRow | None = None
    chosen = layer
    out = Path(out_dir) if out_dir is not None else None
    with simulated_group(tp) as group, record_placements():
        plan.group = group.name
        for gi, g in enumerate(graphs):
            ctx = PassContext(param_names=g.param_names, tp=group, fixed=dict(plan.params))
            is_main = gi == main
            name = f"graph {gi}" if len(graphs) > 1 else ""
            dumper = GraphDumper(str(out / "graphs") if out else None, name=f"graph_{gi}",
                                 drawings=False)  # fmt: skip
            if is_main and chosen is None:
                chosen = draw.GraphView(g.gm, g.param_names, g.buffer_names).representative_layer()
            previous: set[str] = set()
            todo = [None, *(c for c in PIPELINE if opts.enabled(c.name))]
            for k, cls in enumerate(todo):
                stage_name = "input" if cls is None else cls.name
                if cls is not None:
                    try:
                        cls(ctx, opts.passes[cls.name])(g.gm.graph)
                    except BoostError:
                        raise
                    except Exception as err:  # a pass's bug: show it, keep what ran
                        msg = f"pass {cls.name!r} failed on graph {gi}: {type(err).__name__}: {err}"
                        log.error("explain: %s", msg, exc_info=True)
                        errors.append(msg)
                        break
                dumper(stage_name, g.gm)
                if standard is None and ctx.bottlenecks:
                    standard = _standard_estimate(g.gm, ctx.bottlenecks)
                stage = stages.setdefault(stage_name, Stage(k, stage_name))
                records = _recorded(ctx)
                view = draw.GraphView(
                    g.gm, g.param_names, g.buffer_names, records, ctx.bottlenecks,
                    title=f"{type(model).__name__} after {stage_name}", id_prefix="",
                )  # fmt: skip
                for node in view.nodes:  # graph order: layers in order
                    where = view.group[node]
                    for c in view.records.get(node.name, []):
                        stage.collectives.append(
                            CollectiveRow(stage_name, f"{name}:{where}" if name else where, c)
                        )
                if view.stale:
                    errors.append(f"{stage_name}: recorded collectives name missing nodes "
                                  f"{[c.node for c in view.stale]}")  # fmt: skip
                if is_main:
                    names = {n.name for n in view.nodes}
                    stage.nodes = len(names)
                    if k:
                        stage.added = sorted(
                            names - previous, key=lambda s: view.index[view.by_name[s]]
                        )
                        stage.removed = sorted(previous - names)
                    previous = names
                    if chosen is not None:
                        stage.layer_dot = view.layer_dot(chosen, f"{chosen} after {stage_name}")
                    stage.model_dot = view.model_dot(chosen, f"{type(model).__name__} after "
                                                     f"{stage_name}: one box per layer")  # fmt: skip
            for note in ctx.notes.values():
                plan.params.update(getattr(note, "params", {}) or {})
                plan.fallbacks += list(getattr(note, "fallbacks", []) or [])
            seen = {(b.down, b.up) for b in plan.bottlenecks}
            plan.bottlenecks += [b for b in ctx.bottlenecks if (b.down, b.up) not in seen]
    ordered = sorted(stages.values(), key=lambda s: s.index)
    if ordered:
        plan.collectives = [row.collective for row in ordered[-1].collectives]
    dtypes: dict[str, torch.dtype] = {}
    for fqn, prm in model.named_parameters():
        plan.param_shapes[fqn] = tuple(prm.shape)
        plan.params.setdefault(fqn, R)
        dtypes[fqn] = prm.dtype
    report = Report(
        type(model).__name__, tp, list(plan.bottlenecks), plan, dtypes, ordered, chosen,
        _cost_rows(plan, ordered, standard, model, example_inputs, tp), len(graphs),
        out, errors=errors,
    )  # fmt: skip
    report.seconds = time.perf_counter() - t0
    if out is not None:
        _write(report)
        report.seconds = time.perf_counter() - t0
    log.info("explain: %s, tp=%d, %.1f s", report.model_name, tp, report.seconds)
    return report


def _cost_rows(
    plan: TPPlan, stages: list[Stage], standard: CostRow | None, model: nn.Module,
    example_inputs: Sequence[Any], tp: int,
) -> list[CostRow]:  # fmt: skip
    rows = []
    for stage in stages:
        if not stage.collectives:
            continue
        sub = TPPlan(p=tp, group=plan.group, collectives=[r.collective for r in stage.collectives])
        pc = plan_comm(sub)
        final = stage is stages[-1]
        rows.append(
            CostRow(
                "this plan (all passes)" if final else f"plan after {stage.name}",
                pc.forward_bytes,
                pc.backward_bytes,
                pc.forward_collectives,
                pc.backward_collectives,
                "captured example, payload convention",
            )  # fmt: skip
        )
    rows.sort(key=lambda r: not r.name.startswith("this plan"))
    if standard is not None:
        rows.append(standard)
    rows += _formula_rows(model, example_inputs, tp)
    return rows


def _write(report: Report) -> None:
    from .page import write_html

    out = report.out_dir
    assert out is not None
    out.mkdir(parents=True, exist_ok=True)
    report.dot = draw.dot_available()
    for stage in report.stages:
        for kind, text in (("layer", stage.layer_dot), ("model", stage.model_dot)):
            if not text:
                continue
            dot_path = out / f"{stage.slug}.{kind}.dot"
            stage.files[f"{kind}.dot"] = dot_path
            svg = draw.render(text, dot_path)
            if svg is not None:
                stage.files[f"{kind}.svg"] = svg
    report.files["report.html"] = write_html(report, out / "report.html")
