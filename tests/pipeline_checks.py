"""Checks of pipeline parallelism with BTP inside each stage (issue 17), run by tp_harness.

Each rank builds the tiny CoLA-LLaMA (or a tiny transformers Llama made low-rank by
``to_low_rank(method="cola")``) twice from one seed: one copy becomes its pipeline
stage on a ``(pp, dp, tp)`` mesh, the other stays whole as the single-device reference
trained on the whole batch. After every step the pipelined loss and this rank's
stage's gradients, gathered over dp and tp to global shapes, are compared with the
reference's; after the last, every parameter of the stage, with the reference's
parameter of the same name.
What was sent point-to-point is recorded per step (shapes, bytes, peers).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from boost_compiler.models import cola_llama as cola
from boost_compiler.train.pipeline import P2PMeter, build_pipeline, init_pipeline_mesh
from tests.tp_harness import _norm_rel, _rel


def _optimizer(kind: str, params: Any, lr: float = 0.1) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _models(kind: str, n_layers: int) -> tuple[Any, Any, Any, int]:
    """Three identical models (the one to split, the reference, the untouched start),
    how the reference is called, and the vocabulary size.

    ``hf``: transformers' ``LlamaForCausalLM`` converted by ``to_low_rank(method="cola")``
    (``tests.models.make_hf``, what ``--hf-config`` builds), called as the trainer calls it.
    """
    if kind == "cola":
        a, b, c = (cola.build("tiny", seed=0, n_layers=n_layers) for _ in range(3))
        return a, b, c, 256
    if kind.startswith("zoo:"):  # a zoo family (tests/zoo_checks.py), its head untied
        from tests import zoo_checks

        a, b, c = (zoo_checks.build(kind[4:], tie_word_embeddings=False,
                                    num_hidden_layers=n_layers) for _ in range(3))  # fmt: skip
        return a, b, c, zoo_checks.VOCAB
    from tests.models import HF_VOCAB, make_hf

    model, ref, start = (make_hf(0, layers=n_layers)[0] for _ in range(3))
    return model, ref, start, HF_VOCAB


def _loss_of(kind: str, ref: Any, ids: torch.Tensor, masks: dict[str, Any]) -> torch.Tensor:
    if kind == "cola":
        return ref(ids, labels=ids)
    labels = masks.get("labels", ids)
    extra = {k: v for k, v in masks.items() if k != "labels"}
    return ref(ids, labels=labels, use_cache=False, **extra).loss


def _padded(ids: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
    """Left padding of a different length in every row (so micro-batches hold different
    numbers of labelled tokens): the attention mask, position ids from the first real
    token, and labels -100 on the padding."""
    b, s = ids.shape
    pad = torch.randint(0, s // 2, (b,), generator=torch.Generator().manual_seed(100 + step))
    mask = (torch.arange(s).expand(b, s) >= pad[:, None]).long()
    return {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "labels": ids.masked_fill(mask == 0, -100)}  # fmt: skip


def pipelined_step(
    pp: int, dp: int, tp: int, m: int, *, opt: str = "sgd", schedule: str = "1f1b",
    steps: int = 2, batch: int = 4, seq: int = 16, model: str = "cola", compile: bool = False,
    padded: bool = False, virtual: int | None = None, lr: float = 0.1, noise: bool = False,
    world: int, mesh: Any,
) -> dict[str, Any]:  # fmt: skip
    """``steps`` optimizer steps pipelined at (pp, dp, tp) with ``m`` micro-batches vs one device
    (``schedule``'s stages: 2 layers each, or 1 each with ``virtual`` stages per rank;
    ``compile``: each stage's forward through the boost backend; ``padded``: left-padded
    rows with attention masks and position ids, a transformers ``model`` only; ``lr``:
    SGD's, 1e-3 for the zoo's families as ``tests/zoo_checks.py`` explains; ``noise``: also
    train a single-device twin whose parameters are perturbed by 1e-7 relative, and report
    how far float32 rounding alone takes its gradients from the reference's; and, tensor
    by tensor, relative to each tensor's norm: the twin's drift and this run's error, for
    every gradient (worst step) and every parameter after the last step).

    ``batch`` is the global batch (split over dp, then into ``m`` micro-batches);
    ``model``: ``cola`` (the packaged CoLA-LLaMA) or ``hf`` (see :func:`_models`), 2
    layers per stage. Every step the loss and this stage's gradients, gathered to global
    shapes, are compared with the reference's; after the last, the parameters.
    """
    del mesh  # the harness's 1-D world mesh; this check builds its own 3-D one
    kind = model
    stages = pp * (virtual or (2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1))
    whole, ref, start, vocab = _models(kind, 2 * stages if stages == pp else stages)
    mesh3 = init_pipeline_mesh(pp, dp, tp)
    dp_rank = mesh3["dp"].get_local_rank()
    pipe = build_pipeline(whole, mesh3, batch // dp, seq, m, schedule=schedule, compile=compile,
                          masks=padded, virtual_stages=virtual)  # fmt: skip
    compiles_before = _inductor_compiles()
    optim, ref_optim = _optimizer(opt, pipe.parameters(), lr), _optimizer(opt, ref.parameters(), lr)
    meter = P2PMeter()
    loss_err = grad_err = 0.0
    worst_grad = ""
    losses = []
    ref_params = dict(ref.named_parameters())
    events: list[list[Any]] = []  # the last step's gloo collectives: name, input shapes
    twin = _Twin(start, opt, lr) if noise else None
    grad_errs: dict[str, float] = {}  # per gradient, norm-relative, worst step (with noise)
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(step))
        masks = _padded(ids, step) if padded else {}
        mine = {k: v.chunk(dp)[dp_rank] for k, v in masks.items()}
        with meter.watch(), _gloo_events(events if step == steps - 1 else None):
            loss = pipe.step(ids.chunk(dp)[dp_rank], **mine)
        # the dp ranks saw disjoint rows: the global mean loss is their mean
        value = loss.reshape(1).clone()
        dist.all_reduce(value, group=mesh3["dp"].get_group())
        grads = pipe.full_state_dict(grads=True)
        optim.step()
        optim.zero_grad(set_to_none=True)
        want = _loss_of(kind, ref, ids, masks)
        want.backward()
        if twin is not None:
            twin.step(kind, ids, masks, {n: ref_params[n].grad for n in grads})
        for name, g in grads.items():
            err = _rel(g, ref_params[name].grad)
            if err > grad_err:
                grad_err, worst_grad = err, name
            if twin is not None:
                norm_err = _norm_rel(g, ref_params[name].grad)
                grad_errs[name] = max(grad_errs.get(name, 0.0), norm_err)
        ref_optim.step()
        ref_optim.zero_grad(set_to_none=True)
        loss_err = max(loss_err, _rel(value / dp, want.detach().reshape(1)))
        losses.append((value.item() / dp, want.item()))
    whole = _whole_model_gloo(kind, start, mesh3, batch // dp // m, seq) if tp > 1 else []
    full = pipe.full_state_dict()
    param_errs = {name: _rel(t, ref_params[name]) for name, t in full.items()}
    start_sd = start.state_dict()
    moved = max(_rel(t, start_sd[n]) for n, t in full.items())
    per_tensor = {}
    if twin is not None:
        twin_params = dict(twin.model.named_parameters())
        per_tensor = {
            "grad_errs": grad_errs,
            "grad_noise": {n: twin.grad_errs[n] for n in grad_errs},
            "param_errs": {n: _norm_rel(t, ref_params[n]) for n, t in full.items()},
            "param_noise": {n: _norm_rel(twin_params[n], ref_params[n]) for n in full},
        }
    return {
        "stage": pipe.spec.index,
        "stages": [[sp.index, sp.first, sp.last] for sp in pipe.specs],
        "layers": [i for sp in pipe.specs for i in sp.layers],
        "params": sorted(full),
        "grad_params": sorted(grads),
        "loss": loss_err,
        "losses": losses,
        "grad": grad_err,
        "worst_grad": worst_grad,
        "param": max(param_errs.values()),
        "worst_param": max(param_errs, key=param_errs.__getitem__),
        "moved": moved,
        "boundary_shape": list(pipe.boundary_shape),
        "boundary_bytes": pipe.boundary_bytes,
        "sends": [[list(s), b, peer] for s, b, peer in meter.sends],
        "gloo": events,
        "whole_gloo": whole,
        "noise": twin.grad_err if twin is not None else 0.0,
        **per_tensor,
        "ends": stage_ends(pipe.specs, pipe.modules),
        "want_ends": model_ends(kind, start),
        "global_rank": dist.get_rank(),
        "compiled_graphs": _inductor_compiles() - compiles_before,
        "tp_rank": mesh3["tp"].get_local_rank(),
        "dp_rank": dp_rank,
        "fsdp_units": _fsdp_units(pipe.modules),
    }


def _fsdp_units(modules: Any) -> int:
    """FSDP2 units on this rank's stages: one per block at tp = 1, plus each stage."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for mod in modules for m in mod.modules())


TRAIN = {"steps": 3, "batch": 4, "seq": 32, "warmup": 1, "clip": 0.5, "log_every": 100}


def trainer(
    pp: int, m: int | None, *, hf_config: str | None = None, checkpoint_dir: str | None = None,
    pp_layers: tuple[int, ...] | None = None, compile: bool = False,
    eval_data: str | None = None, schedule: str = "1f1b", n_layers: int | None = None,
    world: int, mesh: Any,
) -> dict[str, Any]:  # fmt: skip
    """``train`` with ``pp``/``microbatches`` (the ``--pp N --microbatches M`` path, ``m``
    None: the default count; ``compile``: compiled stages;
    ``hf_config``: ``--hf-config DIR``, a transformers Llama; ``checkpoint_dir``: saved at
    the end, the checkpoint's path returned; ``pp_layers``: ``--pp-layers``; ``eval_data``:
    ``--eval-data FILE --eval-every 2``, validation through the schedule; ``schedule``:
    ``--schedule``; ``n_layers``: the preset's layer count). Also returns
    the stages' layers as the trainer split them."""
    from boost_compiler.train import TrainConfig, train
    from boost_compiler.train import pipeline as pipeline_mod

    del mesh
    split, stages = pipeline_mod.split_layers, []

    def recording_split(*args: Any, **kwargs: Any) -> Any:
        specs = split(*args, **kwargs)
        stages.append([list(s.layers) for s in specs])
        return specs

    pipeline_mod.split_layers = recording_split
    compiles_before = _inductor_compiles()
    try:
        cfg = TrainConfig(**TRAIN, pp=pp, microbatches=m, tp=world // pp, compile=compile,
                          progress=False, hf_config=hf_config, pp_layers=pp_layers,
                          checkpoint_dir=checkpoint_dir, schedule=schedule,
                          model_overrides=_layers(n_layers), **_eval_flags(eval_data))  # fmt: skip
        res = train(cfg)
    finally:
        pipeline_mod.split_layers = split
    return {"losses": res.losses, "grad_norms": res.grad_norms, "stages": stages,
            "eval_losses": res.eval_losses,
            "checkpoint": str(res.checkpoint) if res.checkpoint else None,
            "compiled_graphs": _inductor_compiles() - compiles_before}  # fmt: skip


def _layers(n_layers: int | None) -> dict[str, Any]:
    """The preset's ``[model]`` overrides: its layer count, when given."""
    return {"n_layers": n_layers} if n_layers else {}


class _Twin:
    """The reference's twin, its parameters perturbed by 1e-7 relative: how far float32
    rounding alone moves one device's gradients over the same steps (this model's noise)."""

    def __init__(self, start: Any, opt: str, lr: float) -> None:
        import copy

        self.model = copy.deepcopy(start)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for prm in self.model.parameters():
                prm.mul_(1 + 1e-7 * torch.randn(prm.shape, generator=gen))
        self.optim = _optimizer(opt, self.model.parameters(), lr)
        self.grad_err = 0.0
        self.grad_errs: dict[str, float] = {}  # per gradient, norm-relative, worst step

    def step(self, kind: str, ids: Any, masks: Any, ref_grads: dict[str, Any]) -> None:
        _loss_of(kind, self.model, ids, masks).backward()
        mine = dict(self.model.named_parameters())
        for name, g in ref_grads.items():
            self.grad_err = max(self.grad_err, _rel(mine[name].grad, g))
            drift = _norm_rel(mine[name].grad, g)
            self.grad_errs[name] = max(self.grad_errs.get(name, 0.0), drift)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)


_IN_LAYER = re.compile(r"(^|\.)layers\.\d+\.")  # a decoder layer's parameter, either family


def model_ends(kind: str, model: Any) -> list[list[str]]:
    """The whole model's parameters outside its decoder layers: [the input embedding's,
    the others' (final norm, head)], what the first and the last stage must hold besides
    their layers. Read off the model itself (its embedding module, the names outside
    ``layers.<i>.``), not from ``hf_parts``, which the split uses to cut the stages."""
    embed = model.embed if kind == "cola" else model.get_input_embeddings()
    ids = {id(p) for p in embed.parameters()}
    outside = [(n, p) for n, p in model.named_parameters() if not _IN_LAYER.search(n)]
    return [sorted(n for n, p in outside if id(p) in ids),
            sorted(n for n, p in outside if id(p) not in ids)]  # fmt: skip


def stage_ends(specs: Sequence[Any], modules: Sequence[Any]) -> list[list[str]]:
    """The stage modules' own parameters outside their decoder layers, under the whole
    model's names: [the first stage's, the last stage's, any other stage's] (empty lists
    for the stages this rank does not hold). What the split built, not what it meant to."""
    held: list[list[str]] = [[], [], []]
    for spec, module in zip(specs, modules, strict=True):
        names = {n.removeprefix("stage.") for n, _ in module.named_parameters()}
        outside = sorted(n for n in names if not _IN_LAYER.search(n))
        if spec.first:
            held[0] += outside
        if spec.last:
            held[1] += outside
        if not spec.first and not spec.last:
            held[2] += outside
    return held


def _whole_model_gloo(kind: str, start: Any, mesh3: Any, mb: int, seq: int) -> list[list[Any]]:
    """What gloo runs for one forward + backward of the whole model (a copy of the untouched
    start), parallelized over this rank's tp group, on one micro-batch: the collectives a
    pipeline's stages must add up to per micro-batch if their boundaries add none."""
    import copy

    import boost_compiler

    model = copy.deepcopy(start)
    ids = torch.randint(0, 64, (mb, seq), generator=torch.Generator().manual_seed(7))
    kwargs = {"labels": ids} if kind == "cola" else {"labels": ids, "use_cache": False}
    boost_compiler.parallelize(model, mesh3["tp"], (ids,), kwargs)
    events: list[list[Any]] = []
    with _gloo_events(events):
        _loss_of(kind, model, ids, {}).backward()
    return events


@contextlib.contextmanager
def _gloo_events(out: list[list[Any]] | None) -> Iterator[None]:
    """Record what gloo ran (the profiler's ``gloo:*`` events, with input shapes) into
    ``out``; nothing when ``out`` is None."""
    if out is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield
    out += [[e.name, [list(x) for x in e.input_shapes if x]] for e in prof.events()
            if e.name.startswith("gloo:")]  # fmt: skip


def _eval_flags(eval_data: str | None) -> dict[str, Any]:
    """``--eval-data FILE --eval-every 2 --eval-batches 2`` (nothing without a file)."""
    return {"eval_data": [eval_data], "eval_every": 2, "eval_batches": 2} if eval_data else {}


def _inductor_compiles() -> int:
    """Graphs Inductor compiled or loaded from its caches in this process so far (torch's
    counters, not the config). The eager route of a parallelized stage goes through dynamo
    too, with no Inductor: it counts 0."""
    from torch._dynamo.utils import counters

    inductor = sum(counters["inductor"][k] for k in
                   ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))  # fmt: skip
    return int(inductor + counters["aot_autograd"]["autograd_cache_hit"])


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
