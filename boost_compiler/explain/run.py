"""Running capture, detection and the pass pipeline on a simulated group, stage by stage.

Invariant: ``explain`` runs the backend's pipeline through the one pass driver on the
captured copies of the model's graphs (the model is not modified, nothing runs on real
ranks), and everything it shows of a stage (collectives per layer, drawings, node
changes) and the plan's collectives are read off that stage's graph, never off records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from .._logging import get_logger
from ..analysis.bottlenecks import Bottleneck
from ..costmodel import LlamaDims, cost, plan_comm
from ..errors import BoostError, OutputPathError
from ..ir.capture import CapturedGraph, capture
from ..ir.ops import value_of
from ..options import BoostOptions
from ..passes import PassContext
from ..passes.driver import enabled_passes, run_pipeline
from ..tp.collectives import graph_collectives
from ..tp.groups import TPGroup, resolve_group
from ..tp.placement import R
from ..tp.plan import TPPlan, input_shapes
from . import draw
from .dump import GraphDumper
from .result import CollectiveRow, CostRow, Report, Stage

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


@dataclass
class _Run:
    """What explaining the graphs of one model gathers, graph after graph."""

    model_name: str
    plan: TPPlan
    layer: str | None  # the drawn layer
    stages: dict[str, Stage] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    standard: CostRow | None = None


class _Snapshots:
    """The pass driver's ``on_stage`` callback for one graph: dumps the stage and adds its
    collectives (per layer), node changes and drawings (main graph only) to its Stage."""

    def __init__(self, run: _Run, g: CapturedGraph, name: str, dumper: GraphDumper,
                 is_main: bool) -> None:  # fmt: skip
        self.run, self.g, self.name, self.dumper, self.is_main = run, g, name, dumper, is_main
        self.done: list[str] = []  # the stages seen, "input" first
        self.previous: set[str] = set()  # the node names of the last stage

    def __call__(self, stage_name: str, gm: fx.GraphModule, ctx: PassContext) -> None:
        self.dumper(stage_name, gm)
        run = self.run
        if run.standard is None and ctx.bottlenecks:  # detected, not rewritten yet
            run.standard = _standard_estimate(gm, ctx.bottlenecks)
        stage = run.stages.setdefault(stage_name, Stage(len(self.done), stage_name))
        collectives = graph_collectives(gm.graph)
        view = draw.GraphView(
            gm, self.g.param_names, self.g.buffer_names, collectives, ctx.bottlenecks,
            title=f"{run.model_name} after {stage_name}", id_prefix="",
        )  # fmt: skip
        for c in collectives:
            where = view.group[view.by_name[c.node]]
            layer = f"{self.name}:{where}" if self.name else where
            stage.collectives.append(CollectiveRow(stage_name, layer, c))
        if self.is_main:
            self._draw(stage, view)
        self.done.append(stage_name)

    def _draw(self, stage: Stage, view: draw.GraphView) -> None:
        names = {n.name for n in view.nodes}
        stage.nodes = len(names)
        if self.done:
            stage.added = sorted(names - self.previous, key=lambda s: view.index[view.by_name[s]])
            stage.removed = sorted(self.previous - names)
        self.previous = names
        layer, model = self.run.layer, self.run.model_name
        if layer is not None:
            stage.layer_dot = view.layer_dot(layer, f"{layer} after {stage.name}")
        stage.model_dot = view.model_dot(layer, f"{model} after {stage.name}: one box per layer")

    def failed_pass(self, options: BoostOptions) -> str:
        """The pass that raised: the one after the last stage seen."""
        names = [cls.name for cls in enabled_passes(options)]
        return names[len(self.done) - 1] if 0 < len(self.done) <= len(names) else "?"


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
        from boost_compiler.models.factories import cola_llama_tiny

        model, inputs, kwargs = cola_llama_tiny()   # (model, example inputs, example kwargs)
        report = explain(model, inputs, tp=2, out_dir="boost-report", example_kwargs=kwargs)
        rich.print(report)   # then open boost-report/report.html
    """
    t0 = time.perf_counter()
    opts = BoostOptions.parse(options)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        _check_out_dir(out)  # before the capture: a bad --out found after it wastes the run
    graphs = capture(model, tuple(example_inputs), example_kwargs)
    main = max(range(len(graphs)), key=lambda i: len(graphs[i].gm.graph.nodes))
    run = _Run(type(model).__name__, TPPlan(p=tp, group=""), layer)
    with simulated_group(tp) as group:
        run.plan.group = group.name
        for gi, g in enumerate(graphs):
            if gi == main and run.layer is None:
                run.layer = draw.GraphView(
                    g.gm, g.param_names, g.buffer_names, ()
                ).representative_layer()
            name = f"graph {gi}" if len(graphs) > 1 else ""
            dumper = GraphDumper(str(out / "graphs") if out else None, name=f"graph_{gi}",
                                 drawings=False)  # fmt: skip
            _explain_graph(run, g, gi, _Snapshots(run, g, name, dumper, gi == main), group, opts)
    report = _report(run, model, example_inputs, tp, len(graphs), out)
    report.seconds = time.perf_counter() - t0
    if out is not None:
        _write(report)
        report.seconds = time.perf_counter() - t0
    log.info("explain: %s, tp=%d, %.1f s", report.model_name, tp, report.seconds)
    return report


def _check_out_dir(out: Path) -> None:
    """The report folder can be made: neither it nor a folder above it is a file."""
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == out else f"is under {p}, a file"
            raise OutputPathError(f"--out (out_dir) {out} {what}: the report is a folder (report.html, "
                                  "plan.json, drawings): give a folder's path")  # fmt: skip


def _explain_graph(
    run: _Run, g: CapturedGraph, gi: int, snapshots: _Snapshots, group: TPGroup,
    opts: BoostOptions,
) -> None:  # fmt: skip
    """Run the pipeline on one graph, snapshotting each stage; fold its results into the plan.

    A pass that fails with anything but a BoostError (a pass's bug) is reported and
    ends this graph's pipeline; the stages before it are kept.
    """
    plan = run.plan
    ctx = PassContext(param_names=g.param_names, tp=group, fixed=dict(plan.params))
    try:
        run_pipeline(g.gm, ctx, opts, on_stage=snapshots)
    except BoostError:
        raise
    except Exception as err:  # noqa: BLE001 - shown in the report, the other stages kept
        failed = snapshots.failed_pass(opts)
        msg = f"pass {failed!r} failed on graph {gi}: {type(err).__name__}: {err}"
        log.error("explain: %s", msg, exc_info=True)
        run.errors.append(msg)
    plan.add_graph("explain", input_shapes(g.example_inputs), ctx.notes.get("btp"),
                   ctx.bottlenecks, graph_collectives(g.gm.graph))  # fmt: skip


def _report(
    run: _Run, model: nn.Module, example_inputs: Sequence[Any], tp: int, n_graphs: int,
    out: Path | None,
) -> Report:  # fmt: skip
    """The report: the plan completed with every parameter's shape, placement and dtype."""
    plan = run.plan
    dtypes: dict[str, torch.dtype] = {}
    for fqn, prm in model.named_parameters():
        plan.param_shapes[fqn] = tuple(prm.shape)
        plan.params.setdefault(fqn, R)
        dtypes[fqn] = prm.dtype
    stages = sorted(run.stages.values(), key=lambda s: s.index)
    return Report(
        run.model_name, tp, list(plan.bottlenecks), plan, dtypes, stages, run.layer,
        _cost_rows(plan, stages, run.standard, model, example_inputs, tp), n_graphs,
        out, errors=run.errors,
    )  # fmt: skip


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
    if report.errors:  # a pass failed: the plan is partial, and forcing it would mislead
        log.warning("explain: plan.json not written (%d pass error(s))", len(report.errors))
    else:
        report.files["plan.json"] = report.plan.save(out / "plan.json", report.model_name)
    report.files["report.html"] = write_html(report, out / "report.html")
