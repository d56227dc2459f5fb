"""Everything before step 0, in torchtitan's order of steps, for the loop and the pipeline.

:func:`setup` builds a run's :class:`Run`: the mesh, the data, the model
(:func:`build_model`), then the steps a layout asks for, each one function that both
``(dp, tp)`` runs and pipelined ``(pp, dp, tp)`` runs call: :func:`apply_btp`
(``parallelize`` over ``tp``), :func:`apply_fsdp` (FSDP2 over ``dp``, per block: ``fsdp.py``),
:func:`apply_compile` (``torch.compile(backend="boost")``), and
:func:`make_optimizer`. Invariant: one device choice (:func:`pick_device`) and one
optimizer for both, so a pipelined run trains what the same run without ``pp`` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import pick_device
from ..parallel.shadow import parallel_state
from . import checkpoint as ckpt
from . import comm
from . import fsdp as fsdp_units
from .clip import GradSlot
from .config import TrainConfig
from .data import DataSource, load_corpus, open_data, open_eval
from .families import spec_for
from .model_spec import ModelSpec
from .pipeline import build_pipeline, init_pipeline_mesh


def build_model(cfg: TrainConfig) -> nn.Module:
    """The run's model as its family's spec builds it (identical on every rank):
    :func:`.families.spec_for` picks the preset, ``--hf-config`` / ``--init-from``'s
    transformers model, or a ``--model module:function``."""
    return spec_for(cfg).build(cfg)


def make_optimizer(
    layout: ckpt.Layout, cfg: TrainConfig, tp: int
) -> tuple[list[GradSlot], torch.optim.AdamW]:
    """AdamW over the layout's parameters (no decay on vectors) and their clipping slots."""
    slots = [GradSlot(e.param, tp > 1 and e.placement.is_shard) for e in layout.entries]  # type: ignore[arg-type]
    decay = [e.param for e in layout.entries if e.param.ndim >= 2]
    no_decay = [e.param for e in layout.entries if e.param.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
    )  # fmt: skip
    return slots, opt


@dataclass
class Run:
    """Everything a training run holds between steps, on this rank."""

    cfg: TrainConfig
    dp: int
    tp: int
    mesh: Any
    device: torch.device
    corpus: DataSource
    model: nn.Module
    forward: Any
    opt: torch.optim.Optimizer
    layout: ckpt.Layout
    slots: list[GradSlot]
    fsdp: bool
    tp_bytes: int
    dp_bytes: int
    pipe: Any = None  # a .pipeline.Pipeline when pp > 1 (it runs forward and backward)
    norm_group: Any = None  # pp > 1: the group the gradient norm's squares are summed over
    held_out: torch.Tensor | None = None  # [batches, batch, seq] validation sequences
    spec: ModelSpec | None = None  # the model family's answers (.model_spec)

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def batch(self, step: int) -> torch.Tensor:
        return self.corpus.rows(step).to(self.device)


def plan_bytes(model: nn.Module) -> int:
    """Forward + backward payload bytes per step of the model's BTP plan (0 without one)."""
    state = parallel_state(model)
    if state is None:
        return 0
    return sum(c.nbytes * (int(c.forward) + int(c.backward)) for c in state.plan.collectives)


def apply_btp(model: nn.Module, cfg: TrainConfig, tp_mesh: Any, example: torch.Tensor) -> None:
    """``parallelize`` over ``tp`` with the batch's shape as the example (at tp=1: nothing)."""
    import boost_compiler

    if cfg.tp > 1:
        kwargs = {"labels": example, **spec_for(cfg).example_kwargs()}
        boost_compiler.parallelize(model, tp_mesh, (example,), kwargs)


def apply_fsdp(model: nn.Module, dp_mesh: Any, cfg: TrainConfig) -> None:
    """FSDP2 over ``dp``: per block, then the root, in ``--mixed-precision`` (:mod:`.fsdp`)."""
    fsdp_units.shard(model, dp_mesh, cfg.mixed_precision)


def uses_fsdp(cfg: TrainConfig, dp: int) -> bool:
    """Whether FSDP2 wraps the model: at dp > 1 unless ``--no-fsdp``, and always under
    ``--mixed-precision``.

    At dp = 1 torchtitan gets bf16 compute from ``torch.autocast`` instead (and none at
    all with TP or PP only). Here FSDP2 on the one-rank dp mesh gives it: the same
    ``MixedPrecisionPolicy`` then computes every layout's step (the model's own ops in
    bf16, gradients reduced in fp32), so a run's losses agree across (dp, tp) layouts
    up to rounding, as in fp32; autocast would keep some ops fp32 at dp = 1 only.
    """
    return (dp > 1 and cfg.fsdp) or cfg.mixed_precision != "none"


def apply_compile(model: nn.Module, cfg: TrainConfig, fsdp: bool) -> Any:
    """What the loop calls for a forward: the model, compiled with the boost backend if asked."""
    forward: Any = model
    if cfg.compile:
        if fsdp:
            # FSDP2's hooks stay eager around the module call; the forward they wrap is compiled.
            model.forward = torch.compile(model.forward, backend="boost")  # type: ignore[method-assign]
        else:
            forward = torch.compile(model, backend="boost")
    return spec_for(cfg).loss_forward(forward)  # the loop and validation want the loss


def setup(cfg: TrainConfig) -> Run:
    """Mesh, data, model (parallelized, sharded), optimizer: everything before step 0."""
    world = dist.get_world_size()
    cfg.validate(world)
    spec = spec_for(cfg)
    spec.check(cfg)
    if cfg.pp > 1:
        # The pipeline builds its run with the embedded corpus; the data is swapped in here.
        run = setup_pipeline_run(dataclasses.replace(cfg, data=None))
        run.cfg, run.corpus = cfg, open_data(cfg, run.dp_rank, run.dp)
        run.held_out, run.spec = open_eval(cfg), spec
        return run
    tp = cfg.tp
    dp = cfg.dp if cfg.dp is not None else world // tp
    device = pick_device()
    mesh = comm.device_mesh(device.type, (dp, tp), ("dp", "tp"), comm.timeout_of(cfg.comm_timeout))
    corpus = open_data(cfg, mesh["dp"].get_local_rank(), dp)
    model = build_model(cfg).to(device)
    if cfg.bf16:
        model = model.to(torch.bfloat16)
    apply_btp(model, cfg, mesh["tp"], corpus.example().to(device))
    fsdp = uses_fsdp(cfg, dp)
    if fsdp:
        apply_fsdp(model, mesh["dp"], cfg)
    layout = ckpt.model_layout(model, mesh["tp"] if tp > 1 else None)
    slots, opt = make_optimizer(layout, cfg, tp)
    forward = apply_compile(model, cfg, fsdp)
    return Run(cfg, dp, tp, mesh, device, corpus, model, forward, opt, layout, slots, fsdp,
               plan_bytes(model), fsdp_units.dp_bytes([model], dp, fsdp, cfg.mixed_precision),
               held_out=open_eval(cfg), spec=spec)  # fmt: skip


def setup_pipeline_run(cfg: TrainConfig) -> Run:
    """:func:`setup` at ``cfg.pp > 1``: this rank's stage on a ``(pp, dp, tp)`` mesh.

    The run's ``model`` is the stage under single-device names (its checkpoint layout,
    clip slots and optimizer groups are those of its parameters); the gradient norm's
    squares are summed over pp (disjoint stages) and, under FSDP2, dp (disjoint shards).
    Checkpoints: each stage saves its own parameters and moments under their global
    names (``layers.3...``, TP shards as for a (dp, tp) run), and the layout's ``keys``
    are the whole model's, which ``train_state.json`` records and a load checks: so a
    checkpoint holds one model, whatever pp saved it or loads it.
    """
    world = dist.get_world_size()
    tp, pp = cfg.tp, cfg.pp
    dp = cfg.dp if cfg.dp is not None else world // (tp * pp)
    device = pick_device()
    timeout = comm.timeout_of(cfg.comm_timeout)
    mesh = init_pipeline_mesh(pp, dp, tp, device.type, timeout)
    spec = spec_for(cfg)
    model = build_model(cfg).to(device)
    if cfg.bf16:
        model = model.to(torch.bfloat16)
    model_keys = list(model.state_dict().keys())  # before the split: every stage's names
    fsdp = uses_fsdp(cfg, dp)
    pipe = build_pipeline(
        model, mesh, cfg.batch // dp, cfg.seq, cfg.micro_batches(dp), fsdp=fsdp,
        layer_counts=cfg.pp_layers, compile=cfg.compile, schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages, model_spec=spec,
    )  # fmt: skip
    stages = [m.stage for m in pipe.modules]  # this rank's, one per virtual stage
    layout = _stages_layout(stages, mesh["tp"] if tp > 1 else None)
    layout.keys = model_keys
    stage = stages[0]
    slots, opt = make_optimizer(layout, cfg, tp)
    norm_group = comm.group_over(mesh, ("pp", "dp"), timeout) if fsdp else mesh["pp"].get_group()
    return Run(cfg, dp, tp, mesh, device, load_corpus(cfg.data), stage, None, opt,
               layout, slots, fsdp, sum(plan_bytes(s) for s in stages),
               fsdp_units.dp_bytes(stages, dp, fsdp, cfg.mixed_precision), pipe,
               norm_group, spec=spec)  # fmt: skip


def _stages_layout(stages: list[nn.Module], tp_mesh: Any) -> ckpt.Layout:
    """One layout over this rank's stages (their parameter names are disjoint: each
    stage holds its own layers under the whole model's names)."""
    parts = [ckpt.model_layout(s, tp_mesh) for s in stages]
    out = parts[0]
    for part in parts[1:]:
        out.entries += part.entries
        out.buffers.update(part.buffers)
        out.aliases.update(part.aliases)
        out.tp_mesh = out.tp_mesh or part.tp_mesh
    return out
