"""Checks of tests/test_agreement.py: ranks given different things, on one gloo world.

Each returns what this rank saw: the losses it trained, or the named error it got and
how long after the call it came (every rank must raise, within seconds, never wait for
a peer until the group's timeout).
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist


def _tiny(seed: int) -> torch.nn.Module:
    from boost_compiler.models.cola_llama import build

    return build("tiny", seed=seed, n_layers=1)


def _ids(model: Any, batch: int = 2, seq: int = 16) -> torch.Tensor:
    from boost_compiler.models.cola_llama import example_inputs

    return example_inputs(model.cfg, batch=batch, seq=seq, seed=3)[0]


def _raised(fn: Any) -> dict[str, Any]:
    from boost_compiler.errors import BoostError

    start = time.monotonic()
    try:
        fn()
    except BoostError as err:
        return {"raised": type(err).__name__, "message": str(err),
                "seconds": time.monotonic() - start}  # fmt: skip
    return {"raised": None, "seconds": time.monotonic() - start}


def seeds_differ(*, world: int, mesh: Any, steps: int = 3) -> dict[str, Any]:
    """Each rank builds the model from its own seed (the README example without a seed):
    the parallelized model trains rank 0's model, whose losses rank 0 computes alone."""
    import boost_compiler

    model = _tiny(seed=11 + dist.get_rank())
    ids = _ids(model)
    ref = _tiny(seed=11)  # rank 0's model, on one device
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})
    losses: dict[str, list[float]] = {"tp": [], "rank0": []}
    for m, key in ((model, "tp"), (ref, "rank0")):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            loss = m(ids, labels=ids)
            loss.backward()
            opt.step()
            losses[key].append(loss.item())
    full = boost_compiler.gather_state_dict(model)
    drift = max(((full[n] - p).abs().max() / p.abs().max().clamp_min(1e-12)).item()
                for n, p in ref.state_dict().items())  # fmt: skip
    return {**losses, "param_err": drift}


class _Scaled(torch.nn.Module):
    """A low-rank LM that also reads tensors held as plain attributes (a fixed random scale
    of the hidden, one of the bottleneck in a list), drawn from the builder's seed."""

    def __init__(self, seed: int, d: int = 32, r: int = 8, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab)
        self.down, self.up = torch.nn.Linear(d, r), torch.nn.Linear(r, d)
        self.scale = torch.rand(d) + 0.5
        self.mid = [torch.rand(r) + 0.5]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        h = h + self.up(torch.nn.functional.silu(self.down(h)) * self.mid[0])
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def plain_attributes_differ(*, world: int, mesh: Any, steps: int = 3) -> dict[str, Any]:
    """Each rank builds a model whose plain tensor attributes come from its own seed: the
    parallelized model, eager and compiled, trains rank 0's, as one device does."""
    import boost_compiler

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    losses: dict[str, list[float]] = {}
    for how in ("eager", "compiled", "rank0"):
        model = _Scaled(seed=11 + (0 if how == "rank0" else dist.get_rank()))
        run = model
        if how != "rank0":
            boost_compiler.parallelize(model, mesh, (ids,))
            if how == "compiled":
                run = torch.compile(model, backend="boost", options={"lowering": "eager"})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[how] = []
        for _ in range(steps):
            opt.zero_grad()
            loss = run(ids)
            loss.backward()
            opt.step()
            losses[how].append(loss.item())
    return losses


def data_missing_on_one_rank(*, world: int, mesh: Any) -> dict[str, Any]:
    """``boost train``'s flag checks with ``--data`` present on rank 0's disk, missing on
    rank 1's (another node): each rank raises, none waits for the other."""
    from boost_compiler.train.config import TrainConfig
    from boost_compiler.train.loop import _check_flags

    folder = tempfile.mkdtemp(prefix="boost-data-")
    path = os.path.join(folder, "train.jsonl")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write('{"text": "one document"}\n')
    return _raised(lambda: _check_flags(TrainConfig(tp=2, data=[path], compile=False)))


def plan_files_differ(*, world: int, mesh: Any) -> dict[str, Any]:
    """Rank 0 forces the model's own plan, rank 1 that plan with one parameter replicated."""
    import boost_compiler
    from boost_compiler import TPPlan
    from boost_compiler.tp.placement import R

    base = _tiny(seed=2)
    ids = _ids(base)
    first = copy.deepcopy(base)
    boost_compiler.parallelize(first, mesh, (ids,), {"labels": ids})
    plan = TPPlan.from_json(first.boost_plan.to_json())
    if dist.get_rank() == 1:
        name = next(n for n, pl in plan.params.items() if pl.is_shard)
        plan.params[name] = R
    folder = tempfile.mkdtemp(prefix=f"boost-plan-{dist.get_rank()}-")
    path = plan.save(os.path.join(folder, "plan.json"))
    model = copy.deepcopy(base)
    res = _raised(lambda: boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids},
                                                     plan=path))  # fmt: skip
    res["modified"] = not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters(), strict=True)
    )
    return res


def batch_shapes_differ(*, world: int, mesh: Any) -> dict[str, Any]:
    """Parallelized alike; then rank 1 calls the model with another batch size."""
    import boost_compiler

    model = _tiny(seed=4)
    ids = _ids(model)
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids})
    mine = _ids(model, batch=2 + dist.get_rank())
    return _raised(lambda: model(mine, labels=mine))


def one_rank_fails(*, world: int, mesh: Any) -> dict[str, Any]:
    """Rank 1's parallelize raises (an unknown option there only); rank 0's would not."""
    import boost_compiler

    model = _tiny(seed=4)
    ids = _ids(model)
    options = {"no_such_option": True} if dist.get_rank() == 1 else {}
    return _raised(lambda: boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids},
                                                      options=options))  # fmt: skip


def example_shapes_differ(*, world: int, mesh: Any) -> dict[str, Any]:
    """The ranks' example inputs for parallelize differ in their batch size."""
    import boost_compiler

    model = _tiny(seed=4)
    ids = _ids(model, batch=2 + dist.get_rank())
    return _raised(lambda: boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}))


def env_option_differs(*, world: int, mesh: Any) -> dict[str, Any]:
    """$BOOST_COMPILE_IN_TURNS (compile_in_turns' default) is set on rank 1 only: its
    compiles would take barriers rank 0's never take."""
    import boost_compiler

    model = _tiny(seed=4)
    ids = _ids(model)
    before = os.environ.get("BOOST_COMPILE_IN_TURNS")
    os.environ["BOOST_COMPILE_IN_TURNS"] = str(dist.get_rank())
    try:
        return _raised(lambda: boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}))
    finally:
        if before is None:
            del os.environ["BOOST_COMPILE_IN_TURNS"]
        else:
            os.environ["BOOST_COMPILE_IN_TURNS"] = before


def non_contiguous_differ(*, world: int, mesh: Any) -> dict[str, Any]:
    """A parameter and a buffer laid out as transposed views, different on each rank:
    after the broadcast both equal rank 0's, still as laid out (strides kept)."""
    from boost_compiler.parallel.agreement import broadcast_from_first
    from boost_compiler.tp.groups import resolve_group

    torch.manual_seed(5 + dist.get_rank())
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.randn(3, 4).t())
    m.register_buffer("b", torch.randn(5, 2).t())
    strides = (m.w.stride(), m.b.stride())
    # gloo copies a strided tensor for itself; NCCL refuses one ("Tensors must be
    # contiguous"): hold gloo to NCCL's rule, so the CPU run fails where a GPU run would.
    broadcast = dist.broadcast

    def nccl_like(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not t.is_contiguous():
            raise ValueError("Tensors must be contiguous (NCCL's precondition)")
        return broadcast(t, *args, **kwargs)

    dist.broadcast = nccl_like
    try:
        sent = broadcast_from_first(m, resolve_group(mesh))
    finally:
        dist.broadcast = broadcast
    torch.manual_seed(5)
    w0, b0 = torch.randn(3, 4).t(), torch.randn(5, 2).t()
    return {"sent": sent, "equal": bool(torch.equal(m.w, w0) and torch.equal(m.b, b0)),
            "strides_kept": (m.w.stride(), m.b.stride()) == strides}  # fmt: skip
