"""Checks of pipeline parallelism with BTP inside each stage (issue 17), run by tp_harness.

Each rank builds the tiny CoLA-LLaMA twice from one seed: one copy becomes its
pipeline stage on a ``(pp, dp, tp)`` mesh, the other stays whole as the single-device
reference trained on the whole batch. After every step the pipelined loss is compared
with the reference's; after the last, every parameter of this rank's stage, gathered
over dp and tp to its global shape, with the reference's parameter of the same name.
What was sent point-to-point is recorded per step (shapes, bytes, peers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from boost_compiler.models import cola_llama as cola
from boost_compiler.train.pipeline import P2PMeter, build_pipeline, init_pipeline_mesh
from tests.tp_harness import _rel


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def pipelined_step(
    pp: int, dp: int, tp: int, m: int, *, opt: str = "sgd", schedule: str = "1f1b",
    steps: int = 2, batch: int = 4, seq: int = 16, world: int, mesh: Any,
) -> dict[str, Any]:  # fmt: skip
    """``steps`` optimizer steps pipelined at (pp, dp, tp) with ``m`` micro-batches vs one device.

    ``batch`` is the global batch (split over dp, then into ``m`` micro-batches).
    """
    del mesh  # the harness's 1-D world mesh; this check builds its own 3-D one
    overrides = {"n_layers": 2 * pp}
    model = cola.build("tiny", seed=0, **overrides)
    ref = cola.build("tiny", seed=0, **overrides)
    mesh3 = init_pipeline_mesh(pp, dp, tp)
    dp_rank = mesh3["dp"].get_local_rank()
    pipe = build_pipeline(model, mesh3, batch // dp, seq, m, schedule=schedule)
    optim, ref_optim = _optimizer(opt, pipe.module.parameters()), _optimizer(opt, ref.parameters())
    meter = P2PMeter()
    loss_err = 0.0
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(step))
        with meter.watch():
            loss = pipe.step(ids.chunk(dp)[dp_rank])
        # the dp ranks saw disjoint rows: the global mean loss is their mean
        value = loss.reshape(1).clone()
        dist.all_reduce(value, group=mesh3["dp"].get_group())
        optim.step()
        optim.zero_grad(set_to_none=True)
        want = ref(ids, labels=ids)
        want.backward()
        ref_optim.step()
        ref_optim.zero_grad(set_to_none=True)
        loss_err = max(loss_err, _rel(value / dp, want.detach().reshape(1)))
        losses.append((value.item() / dp, want.item()))
    full = pipe.full_state_dict()
    ref_params = dict(ref.named_parameters())
    param_errs = {name: _rel(t, ref_params[name]) for name, t in full.items()}
    moved = max(_rel(t, cola.build("tiny", seed=0, **overrides).state_dict()[n]) for n, t in
                full.items())  # fmt: skip
    return {
        "stage": pipe.spec.index,
        "layers": list(pipe.spec.layers),
        "params": sorted(full),
        "loss": loss_err,
        "losses": losses,
        "param": max(param_errs.values()),
        "worst_param": max(param_errs, key=param_errs.__getitem__),
        "moved": moved,
        "boundary_shape": list(pipe.boundary_shape),
        "boundary_bytes": pipe.boundary_bytes,
        "sends": [[list(s), b, peer] for s, b, peer in meter.sends],
        "global_rank": dist.get_rank(),
        "tp_rank": mesh3["tp"].get_local_rank(),
        "dp_rank": dp_rank,
    }


TRAIN = {"steps": 3, "batch": 4, "seq": 32, "warmup": 1, "clip": 0.5, "log_every": 100}


def trainer(pp: int, m: int, *, world: int, mesh: Any) -> dict[str, Any]:
    """``train`` with ``pp``/``microbatches`` (the ``--pp N --microbatches M`` path)."""
    from boost_compiler.train import TrainConfig, train

    del mesh
    cfg = TrainConfig(**TRAIN, pp=pp, microbatches=m, tp=world // pp, compile=False,
                      progress=False)  # fmt: skip
    res = train(cfg)
    return {"losses": res.losses, "grad_norms": res.grad_norms}


def resumed_trainer(
    pp: int, dp: int, tp: int, ckdir: str, stop_at: int, *, steps: int, m: int = 2,
    world: int, mesh: Any, **kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """``train`` at (pp, dp, tp) up to step ``stop_at`` of ``steps``, resuming from and saving
    to ``ckdir`` (the ``--checkpoint-dir ... --resume --stop-at`` path)."""
    from boost_compiler.train import TrainConfig, train

    del mesh, world
    cfg = TrainConfig(**{**TRAIN, "steps": steps}, pp=pp, dp=dp, tp=tp, microbatches=m,
                      checkpoint_dir=ckdir, resume=True, stop_at=stop_at, compile=False,
                      progress=False, **kw)  # fmt: skip
    res = train(cfg)
    return {"losses": res.losses, "grad_norms": res.grad_norms, "start": res.start_step,
            "checkpoint": str(res.checkpoint)}  # fmt: skip
