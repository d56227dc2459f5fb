"""Pipeline parallelism over ``pp``, BTP inside each stage over ``tp``, FSDP2 over ``dp``.

Layout: a 3-D ``DeviceMesh`` ``(pp, dp, tp)``. The model is cut by layer into ``pp``
stages by its family's spec (``ModelSpec.stage``, :mod:`.model_spec`) (stage 0:
embedding + its layers; the last: its layers + final norm + LM head + loss); each
stage module is parallelized on its own with
``parallelize(stage, mesh["tp"], <that stage's micro-batch inputs>)`` and, at
``dp > 1``, wrapped by ``fully_shard`` over ``mesh["dp"]`` (per block, then the stage,
at tp = 1: ``fsdp.py``). Scheduling is torch's
(``PipelineStage`` with ``Schedule1F1B``; ``ScheduleGPipe``, ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` on request, the last two with ``v`` virtual stages per
rank placed round-robin).
Invariant: what crosses a stage boundary is this tp rank's hidden shard
``[b/m, s, d/tp]``, sent to the same tp rank of the next stage, with no collective on
either side of the wire, and the pipelined step computes the single-device step
exactly. How: each stage's forward takes the shard in with ``from_tp_shards`` and hands
its hidden on with ``to_tp_shard`` (``tp/shard_boundary.py``); inside the stage's
parallelized graph both are aliases of the residual stream's ``S(-1)`` shard, so
neither the sender's output nor the receiver's input is all-gathered, forward or
backward (``tests/test_pipeline.py`` counts gloo's events against the whole model's).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import pick_device
from ..errors import PipelineError
from ..tp.collectives import group_name_of
from .comm import device_mesh
from .families import spec_of
from .model_spec import ModelSpec
from .p2p import P2PMeter
from .schedules import MULTI, SCHEDULES, check_schedule, make_schedule
from .stages import StageSpec, split_layers

__all__ = [
    "SCHEDULES",
    "P2PMeter",
    "Pipeline",
    "StageSpec",
    "build_pipeline",
    "init_pipeline_mesh",
    "split_layers",
]


class BoundaryStage(nn.Module):
    """The module ``PipelineStage`` runs: a (parallelized) stage, its boundaries contiguous.

    At tp > 1 the stage itself takes and returns its hidden shard (``from_tp_shards`` /
    ``to_tp_shard`` inside its forward, see :meth:`.model_spec.ModelSpec.stage`), so
    what arrives and leaves here is ``[b/m, s, d/tp]`` with no collective on either side;
    this wrapper only makes both directions' buffers contiguous and owned, as gloo's
    sends need.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, **masks: torch.Tensor
    ) -> torch.Tensor:
        spec = self.stage.spec
        if not spec.first:
            x = _ContiguousGrad.apply(x)
        # Only the last stage was captured with labels: the others' graphs take none.
        out = self.stage(x, labels=labels, **masks) if spec.last else self.stage(x, **masks)
        if spec.last or (out._base is None and out.is_contiguous()):
            return out
        # A view (the graph may return its shard as an alias of the residual stream) is
        # copied: zero bubble detaches the stage's output in place, which a view refuses.
        return out.clone(memory_format=torch.contiguous_format)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of the
    received shard is a slice of the replicated one, and it is sent back as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def init_pipeline_mesh(
    pp: int,
    dp: int,
    tp: int,
    device: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> Any:
    """The ``(pp, dp, tp)`` mesh; the world must have exactly ``pp * dp * tp`` ranks.

    ``device``: the mesh's device type (default: this process's, :func:`pick_device`). Its
    groups wait at most ``timeout`` for a peer (None: torch's default; see train/comm.py).
    """
    device = device or pick_device().type
    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise PipelineError(f"pp*dp*tp = {pp}*{dp}*{tp} = {pp * dp * tp} != world size {world}")
    return device_mesh(device, (pp, dp, tp), ("pp", "dp", "tp"), timeout)


IGNORE_INDEX = -100  # the label of a position no loss is taken at (HF's, torch's default)


@dataclass
class TokenWeightedLoss:
    """The schedule's loss function. The last stage's graph already computed each
    micro-batch's loss (sharded head and cross-entropy under BTP): a mean over that
    micro-batch's labelled tokens. Weighted by ``m * dp * n_i / N`` (``n_i`` its labelled
    tokens, ``N`` the global batch's), the schedule's mean over micro-batches and FSDP2's
    over dp give the mean over every labelled token, which is what one device computes on
    a padded batch; with no padding every weight is exactly 1."""

    micro_batches: int
    dp: int
    total: torch.Tensor | None = None  # N, set by Pipeline.step before each schedule step

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.total is not None, "Pipeline.step sets the token count first"
        n = (target[:, 1:] != IGNORE_INDEX).sum()
        return output * (n * (self.micro_batches * self.dp)) / self.total


@dataclass
class Pipeline:
    """This rank's stages, their modules (parameters under single-device names), the schedule.

    One stage per rank (``1f1b``, ``gpipe``) or ``v`` virtual stages per rank
    (``interleaved-1f1b``, ``zero-bubble``): ``specs`` and ``modules`` in stage order.
    """

    mesh: Any
    specs: tuple[StageSpec, ...]
    modules: tuple[nn.Module, ...]  # BoundaryStage each, possibly FSDP2-wrapped
    stages: tuple[Any, ...]  # torch.distributed.pipelining.PipelineStage each
    schedule: Any
    n_microbatches: int
    boundary_shape: tuple[int, ...]  # what one micro-batch sends across a boundary, per rank
    dtype: torch.dtype = torch.float32
    loss_fn: TokenWeightedLoss = field(default_factory=lambda: TokenWeightedLoss(1, 1))
    losses: list[torch.Tensor] = field(default_factory=list)

    @property
    def spec(self) -> StageSpec:
        """The one stage of a single-stage schedule (the first of this rank's otherwise)."""
        return self.specs[0]

    @property
    def module(self) -> nn.Module:
        """The one stage module of a single-stage schedule (refused with several)."""
        if len(self.modules) != 1:
            raise PipelineError(f"this rank holds {len(self.modules)} stages: use .modules")
        return self.modules[0]

    @property
    def holds_first(self) -> bool:
        return any(s.first for s in self.specs)

    @property
    def holds_last(self) -> bool:
        return any(s.last for s in self.specs)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stages (for an optimizer)."""
        for module in self.modules:
            yield from module.parameters()

    @property
    def boundary_bytes(self) -> int:
        """Bytes one tp rank sends to the next stage per micro-batch (activation; the
        gradient sent back in backward has the same size)."""
        n = 1
        for s in self.boundary_shape:
            n *= s
        return n * self.dtype.itemsize

    def step(
        self, ids: torch.Tensor, labels: torch.Tensor | None = None, **masks: torch.Tensor
    ) -> torch.Tensor:
        """Forward + backward of the local batch ``ids`` in micro-batches; the mean loss.

        A collective over the pipeline: every rank calls it with its dp rank's batch.
        ``labels`` (default ``ids``; ``-100`` where no loss is taken, as in a padded row)
        and ``masks`` (``attention_mask``, ``position_ids``: those the pipeline was built
        with) are cut into the same micro-batches. Gradients land in the parameters: the
        gradient of the mean loss over the labelled tokens of the global batch (see
        :class:`TokenWeightedLoss`); the loss is broadcast from the last stage to every
        stage, this dp rank's share of that mean times dp.
        """
        return self._run(ids, labels, masks, backward=True)

    def evaluate(
        self, ids: torch.Tensor, labels: torch.Tensor | None = None, **masks: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`step`'s loss with no backward (the schedule's forward-only ``eval``,
        under ``no_grad``): the same micro-batches, weights and broadcast, no gradient
        touched. Validation at ``--pp > 1``."""
        with torch.no_grad():
            return self._run(ids, labels, masks, backward=False)

    def _run(
        self, ids: torch.Tensor, labels: torch.Tensor | None, masks: dict[str, torch.Tensor],
        backward: bool,
    ) -> torch.Tensor:  # fmt: skip
        self.losses = []
        labels = ids if labels is None else labels
        if self.holds_last:
            total = (labels[:, 1:] != IGNORE_INDEX).sum().reshape(1)
            if self.mesh["dp"].size() > 1:
                dist.all_reduce(total, group=self.mesh["dp"].get_group())
            self.loss_fn.total = total[0]
        run = self.schedule.step if backward else self.schedule.eval
        kwargs = {"labels": labels, **masks}
        args = (ids,) if self.holds_first else ()
        if self.holds_last:
            run(*args, target=labels, losses=self.losses, return_outputs=False, **kwargs)
        else:
            run(*args, return_outputs=False, **kwargs)
        loss = torch.zeros((), dtype=torch.float32, device=ids.device)
        if self.holds_last:
            loss = torch.stack([x.detach().float() for x in self.losses]).mean()
        pp_group = self.mesh["pp"].get_group()
        pp = self.mesh["pp"].size()
        src = dist.get_global_rank(pp_group, (self.spec.num_stages - 1) % pp)
        dist.broadcast(loss, src=src, group=pp_group)
        return loss

    def named_parameters_local(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under their single-device names (TP blocks, FSDP2 DTensors at dp > 1)."""
        for module in self.modules:
            for name, prm in module.named_parameters():
                yield name.removeprefix("stage."), prm

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters (``grads``: the gradients of those that have one)
        at global shapes (a collective over dp and tp)."""
        out: dict[str, torch.Tensor] = {}
        for module in self.modules:
            out.update(_full_state_dict(module, grads))
        return out


def _full_state_dict(module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """One stage module's parameters (or gradients) at global shapes."""
    from ..parallel.shadow import parallel_state
    from ..parallel.state_dict import _gather_one
    from ..tp.placement import R

    state = parallel_state(module.stage)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, prm in module.named_parameters():
            name = name.removeprefix("stage.")
            src = prm.grad if grads else prm
            if src is None:
                continue
            full_tensor = getattr(src, "full_tensor", None)
            block = full_tensor() if callable(full_tensor) else src.detach()
            if state is None:
                out[name] = block.clone()
                continue
            plan = state.plan
            placement = plan.params.get(name, R)
            shape = tuple(plan.param_shapes.get(name, tuple(block.shape)))
            out[name] = _gather_one(name, block, placement, shape, plan.group, plan.p).clone()
    return out


def _stage_examples(
    spec: StageSpec, d_model: int, mb: int, seq: int, dtype: torch.dtype, device: torch.device,
    masks: bool = False, tp: int = 1,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:  # fmt: skip
    """One micro-batch's inputs as the stage receives them (the hidden: this tp rank's
    ``[mb, seq, d/tp]``; ``masks``: with an ``attention_mask`` and ``position_ids``, as
    every stage takes them)."""
    ids = torch.zeros(mb, seq, dtype=torch.long, device=device)
    if spec.first:
        args: tuple[torch.Tensor, ...] = (ids,)
    else:
        hidden = torch.randn(mb, seq, d_model // tp, dtype=dtype, device=device)
        args = (hidden.requires_grad_(),)  # as received: the schedule makes it require grad
    kwargs = {"labels": ids} if spec.last else {}
    if masks:
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["position_ids"] = torch.arange(seq, device=device).expand(mb, seq).contiguous()
    return args, kwargs


def _build_stage(
    model: nn.Module, spec: StageSpec, mesh: Any, family: ModelSpec, example: tuple[Any, ...],
    options: dict[str, Any] | None, compile: bool,
) -> nn.Module:  # fmt: skip
    """One stage's module: cut from ``model`` by its family, parallelized over tp, maybe
    compiled."""
    import boost_compiler

    tp = mesh["tp"].size()
    group = group_name_of(mesh["tp"].get_group()) if tp > 1 else None
    stage_mod = family.stage(model, spec, group)
    if tp > 1:
        boost_compiler.parallelize(stage_mod, mesh["tp"], *example, options)
    if compile:
        # As the loop does under FSDP2: the module (its hooks, the boundary) stays eager,
        # the forward it calls is compiled, with this stage's BTP plan at tp > 1.
        compiled = torch.compile(stage_mod.forward, backend="boost")
        stage_mod.forward = compiled  # type: ignore[method-assign]
    return BoundaryStage(stage_mod)


def build_pipeline(
    model: nn.Module,
    mesh: Any,
    batch: int,
    seq: int,
    n_microbatches: int,
    layer_counts: Sequence[int] | None = None,
    schedule: str = "1f1b",
    fsdp: bool = True,
    options: dict[str, Any] | None = None,
    compile: bool = False,
    masks: bool = False,
    virtual_stages: int | None = None,
    model_spec: ModelSpec | None = None,
) -> Pipeline:
    """This rank's stages of ``model`` (identical on every rank), cut by its family's
    ``model_spec`` (default: the registered spec that owns it, :func:`.families.spec_of`).

    ``batch`` is the per-dp-rank batch of one step, cut into ``n_microbatches``;
    ``schedule``: one of :data:`SCHEDULES`; ``interleaved-1f1b`` and ``zero-bubble`` cut
    the model into ``pp * virtual_stages`` stages (default 2 per rank; ``layer_counts``
    then names every stage's layers), the others into ``pp``;
    ``masks``: every step passes ``attention_mask`` and ``position_ids`` (a transformers
    model on padded rows, see :meth:`Pipeline.step`);
    ``compile``: each stage's forward through ``torch.compile(backend="boost")`` (the
    boundary conversions and the schedule stay eager around it).
    """
    from torch.distributed.pipelining import PipelineStage

    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    dp = mesh["dp"].size()
    v = virtual_stages if virtual_stages is not None else (2 if schedule in MULTI else 1)
    check_schedule(schedule, pp, n_microbatches, v, compile)
    if batch % n_microbatches:
        raise PipelineError(f"batch {batch} is not divisible by n_microbatches {n_microbatches}")
    family = model_spec if model_spec is not None else spec_of(model)
    n_layers, d_model, tied = family.pipeline_dims(model)
    if pp > 1 and tied:
        raise PipelineError("tied embeddings would span the first and last stage: untie them")
    if masks and not family.pipeline_masks:
        raise PipelineError(
            f"attention masks and position ids: the {family.name} family's stages take none"
        )
    rank = mesh["pp"].get_local_rank()
    specs = split_layers(n_layers, pp * v, layer_counts)[rank::pp]
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    mb = batch // n_microbatches
    shard = (mb, seq, d_model // tp)

    # requires_grad in the metadata: the received activation's gradient is sent back.
    def act() -> torch.Tensor:
        return torch.empty(shard, dtype=dtype, device=device, requires_grad=True)

    modules, stages = [], []
    for spec in specs:
        example = _stage_examples(spec, d_model, mb, seq, dtype, device, masks, tp)
        module = _build_stage(model, spec, mesh, family, example, options, compile)
        if dp > 1 and fsdp:  # per block, then the stage
            from . import fsdp as fsdp_units

            fsdp_units.shard(module, mesh["dp"])
        inputs = example[0] if spec.first else (act(),)
        output = torch.empty((), dtype=torch.float32, device=device) if spec.last else act()
        stages.append(PipelineStage(
            module, spec.index, spec.num_stages, device, input_args=inputs, output_args=output,
            group=mesh["pp"].get_group(),
        ))  # fmt: skip
        modules.append(module)
    loss_fn = TokenWeightedLoss(n_microbatches, dp)
    sched = make_schedule(stages, n_microbatches, schedule, loss_fn)
    return Pipeline(mesh, tuple(specs), tuple(modules), tuple(stages), sched, n_microbatches,
                    shard, dtype, loss_fn)  # fmt: skip
