"""Pipeline parallelism over ``pp``, BTP inside each stage over ``tp``, FSDP2 over ``dp``.

Layout: a 3-D ``DeviceMesh`` ``(pp, dp, tp)``. The CoLA-LLaMA (or a transformers
causal LM: ``pipeline_hf``) is cut by layer into ``pp`` stages (stage 0:
embedding + its layers; the last: its layers + final norm + LM head + loss); each
stage module is parallelized on its own with
``parallelize(stage, mesh["tp"], <that stage's micro-batch inputs>)`` and, at
``dp > 1``, wrapped by ``fully_shard`` over ``mesh["dp"]``. Scheduling is torch's
(``PipelineStage`` with ``Schedule1F1B``, ``ScheduleGPipe`` on request).
Invariant: what crosses a stage boundary is this tp rank's hidden shard
``[b/m, s, d/tp]``, sent to the same tp rank of the next stage, and the pipelined
step computes the single-device step exactly. Why a shard needs two conversions:
``parallelize`` makes every graph output replicated (``tp/apply.py``), so the
sender slices the stage's replicated output (``scatter_to_tp``, no forward
communication) and the receiver all-gathers it over tp (``gather_from_tp``) before
the next stage's graph slices it again; the P2P wire carries ``1/tp`` of the
activation, the tp groups carry an all-gather of ``[b/m, s, d]`` on each side of
each boundary (forward and backward). A stage graph that returned its shard would
remove those; ``parallelize`` has no such option yet.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import PipelineError
from ..tp.collectives import gather_from_tp, group_name_of, scatter_to_tp
from .comm import device_mesh
from .stages import StageSpec, split_layers

__all__ = [
    "P2PMeter",
    "Pipeline",
    "StageSpec",
    "build_pipeline",
    "init_pipeline_mesh",
    "split_layers",
]


class CoLAStage(nn.Module):
    """A slice of a ``ColaLlama``: its forward is the model's, restricted to the slice.

    Parameter names are the single-device model's (``layers.3.attn...``), so plans,
    checkpoints and comparisons use one vocabulary.
    """

    def __init__(self, model: nn.Module, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.cfg = model.cfg
        self.rope = copy.deepcopy(model.rope)  # every stage needs the tables
        if spec.first:
            self.embed, self.drop = model.embed, model.drop
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        if spec.last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope(x.shape[1])
        if self.spec.first:
            x = self.drop(self.embed(x))
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if not self.spec.last:
            return x
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
        )


class BoundaryStage(nn.Module):
    """The module ``PipelineStage`` runs: a (parallelized) stage with shard-sized boundaries.

    In: the previous stage's hidden shard, all-gathered over tp (its backward keeps this
    rank's slice of the replicated gradient). Out: this rank's slice of the stage's
    replicated output (its backward all-gathers the shard gradients, so the gradient
    the stage's graph sees is replicated, as its exactness requires).
    """

    def __init__(self, stage: nn.Module, tp_group: Any = None) -> None:
        super().__init__()
        self.stage = stage
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.group = group_name_of(tp_group) if tp_group is not None else ""

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, **masks: torch.Tensor
    ) -> torch.Tensor:
        spec = self.stage.spec
        if self.tp > 1 and not spec.first:
            x = gather_from_tp(_ContiguousGrad.apply(x), -1, self.group, self.tp_rank, self.tp)
        # Only the last stage was captured with labels: the others' graphs take none.
        out = self.stage(x, labels=labels, **masks) if spec.last else self.stage(x, **masks)
        if self.tp > 1 and not spec.last:
            # gloo sends only contiguous buffers; a slice of the last dim is not one
            out = scatter_to_tp(out, -1, self.group, self.tp_rank, self.tp).contiguous()
        return out


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
    pp: int, dp: int, tp: int, device: str = "cpu", timeout: datetime.timedelta | None = None
) -> Any:
    """The ``(pp, dp, tp)`` mesh; the world must have exactly ``pp * dp * tp`` ranks.

    Its groups wait at most ``timeout`` for a peer (None: torch's default; see train/comm.py).
    """
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
    """This rank's stage, its module (parameters under single-device names) and schedule."""

    mesh: Any
    spec: StageSpec
    module: nn.Module  # BoundaryStage, possibly FSDP2-wrapped
    stage: Any  # torch.distributed.pipelining.PipelineStage
    schedule: Any
    n_microbatches: int
    boundary_shape: tuple[int, ...]  # what one micro-batch sends across a boundary, per rank
    dtype: torch.dtype = torch.float32
    loss_fn: TokenWeightedLoss = field(default_factory=lambda: TokenWeightedLoss(1, 1))
    losses: list[torch.Tensor] = field(default_factory=list)

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
        self.losses = []
        labels = ids if labels is None else labels
        if self.spec.last:
            total = (labels[:, 1:] != IGNORE_INDEX).sum().reshape(1)
            if self.mesh["dp"].size() > 1:
                dist.all_reduce(total, group=self.mesh["dp"].get_group())
            self.loss_fn.total = total[0]
        kwargs = {"labels": labels, **masks}
        if self.spec.first:
            self.schedule.step(ids, return_outputs=False, **kwargs)
        elif self.spec.last:
            self.schedule.step(target=labels, losses=self.losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(return_outputs=False, **kwargs)
        loss = torch.zeros((), dtype=torch.float32, device=ids.device)
        if self.spec.last:
            loss = torch.stack([x.detach().float() for x in self.losses]).mean()
        pp_group = self.mesh["pp"].get_group()
        src = dist.get_global_rank(pp_group, self.spec.num_stages - 1)
        dist.broadcast(loss, src=src, group=pp_group)
        return loss

    def named_parameters_local(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under their single-device names (TP blocks, FSDP2 DTensors at dp > 1)."""
        for name, prm in self.module.named_parameters():
            yield name.removeprefix("stage."), prm

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This stage's parameters (``grads``: the gradients of those that have one) at
        global shapes (a collective over dp and tp)."""
        from ..tp.placement import R
        from ..tp.shadow import parallel_state
        from ..tp.state_dict import _gather_one

        state = parallel_state(self.module.stage)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, prm in self.named_parameters_local():
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
    masks: bool = False,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:  # fmt: skip
    """One micro-batch's inputs as the stage's graph sees them (full hidden, global shapes;
    ``masks``: with an ``attention_mask`` and ``position_ids``, as every stage takes them)."""
    ids = torch.zeros(mb, seq, dtype=torch.long, device=device)
    if spec.first:
        args: tuple[torch.Tensor, ...] = (ids,)
    else:
        hidden = torch.randn(mb, seq, d_model, dtype=dtype, device=device)
        args = (hidden.requires_grad_(),)  # as received: the schedule makes it require grad
    kwargs = {"labels": ids} if spec.last else {}
    if masks:
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["position_ids"] = torch.arange(seq, device=device).expand(mb, seq).contiguous()
    return args, kwargs


def _make_schedule(stage: Any, n_microbatches: int, schedule: str, loss_fn: Any) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    if schedule not in kinds:
        raise PipelineError(f"unknown schedule {schedule!r}; choose one of {sorted(kinds)}")
    if schedule == "1f1b" and n_microbatches < stage.num_stages:
        raise PipelineError(
            f"1F1B needs n_microbatches >= pp ({n_microbatches} < {stage.num_stages}); "
            "use more micro-batches or schedule='gpipe'"
        )
    return kinds[schedule](stage, n_microbatches, loss_fn=loss_fn)


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
) -> Pipeline:
    """This rank's stage of ``model`` (a ``ColaLlama`` or a transformers causal LM of a
    family ``pipeline_hf`` splits; identical on every rank).

    ``batch`` is the per-dp-rank batch of one step, cut into ``n_microbatches``;
    ``masks``: every step passes ``attention_mask`` and ``position_ids`` (a transformers
    model on padded rows, see :meth:`Pipeline.step`);
    ``compile``: the stage's forward through ``torch.compile(backend="boost")`` (the
    boundary conversions and the schedule stay eager around it).
    """
    from torch.distributed.pipelining import PipelineStage

    import boost_compiler

    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    dp = mesh["dp"].size()
    if batch % n_microbatches:
        raise PipelineError(f"batch {batch} is not divisible by n_microbatches {n_microbatches}")
    from . import pipeline_hf

    hf = pipeline_hf.is_hf_causal_lm(model)
    if hf:
        pipeline_hf.check_tp(model, tp)
        n_layers, d_model, tied = pipeline_hf.hf_dims(model)
    else:
        n_layers, d_model, tied = model.cfg.n_layers, model.cfg.d_model, model.cfg.tie_embeddings
    if pp > 1 and tied:
        raise PipelineError("tied embeddings would span the first and last stage: untie them")
    specs = split_layers(n_layers, pp, layer_counts)
    spec = specs[mesh["pp"].get_local_rank()]
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    stage_mod = pipeline_hf.hf_stage(model, spec) if hf else CoLAStage(model, spec)
    mb = batch // n_microbatches
    if masks and not hf:
        raise PipelineError("attention masks and position ids are for transformers models")
    args, kwargs = _stage_examples(spec, d_model, mb, seq, dtype, device, masks)
    if tp > 1:
        boost_compiler.parallelize(stage_mod, mesh["tp"], args, kwargs, options)
    if compile:
        # As the loop does under FSDP2: the module (its hooks, the boundary) stays eager,
        # the forward it calls is compiled, with this stage's BTP plan at tp > 1.
        compiled = torch.compile(stage_mod.forward, backend="boost")
        stage_mod.forward = compiled  # type: ignore[method-assign]
    module: nn.Module = BoundaryStage(stage_mod, mesh["tp"].get_group() if tp > 1 else None)
    if dp > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=mesh["dp"])
    shard = (mb, seq, d_model // tp)

    # requires_grad in the metadata: the received activation's gradient is sent back.
    def act() -> torch.Tensor:
        return torch.empty(shard, dtype=dtype, device=device, requires_grad=True)

    inputs = args if spec.first else (act(),)
    output = torch.empty((), dtype=torch.float32, device=device) if spec.last else act()
    stage = PipelineStage(
        module, spec.index, pp, device, input_args=inputs, output_args=output,
        group=mesh["pp"].get_group(),
    )  # fmt: skip
    loss_fn = TokenWeightedLoss(n_microbatches, dp)
    sched = _make_schedule(stage, n_microbatches, schedule, loss_fn)
    return Pipeline(mesh, spec, module, stage, sched, n_microbatches, shard, dtype, loss_fn)


@dataclass
class P2PMeter:
    """Bytes the pipeline's point-to-point ops send, and seconds spent waiting on them.

    Patches the two module-level helpers every ``torch.distributed.pipelining``
    schedule calls (``_batch_p2p`` to post a batch of ops, ``_wait_batch_p2p`` to wait
    for it): measurement only, the ops themselves are unchanged.
    """

    sent_bytes: int = 0
    sends: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)  # shape, B, peer
    wait_s: float = 0.0

    @contextlib.contextmanager
    def watch(self) -> Iterator[P2PMeter]:
        from torch.distributed.pipelining import schedules

        post, wait = schedules._batch_p2p, schedules._wait_batch_p2p

        def counted_post(ops: list[dist.P2POp], desc: str | None = None) -> Any:
            for op in ops:
                if op.op in (dist.isend, dist.send):
                    nbytes = op.tensor.numel() * op.tensor.element_size()
                    self.sends.append((tuple(op.tensor.shape), nbytes, op.peer))
                    self.sent_bytes += nbytes
            return post(ops, desc=desc)

        def timed_wait(works: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return wait(works)
            finally:
                self.wait_s += time.perf_counter() - t0

        schedules._batch_p2p, schedules._wait_batch_p2p = counted_post, timed_wait
        try:
            yield self
        finally:
            schedules._batch_p2p, schedules._wait_batch_p2p = post, wait
