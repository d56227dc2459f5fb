"""In-place ops and aliases on sharded activations: the programs of issue 13 at tp=2.

Each model is ordinary single-device code that writes into activations (and a
buffer). A check parallelizes it and compares with an untouched single-device
copy, on every rank: forward outputs element by element, a loss that sees
sign and permutation (``(out * fixed_random).sum()``), every gathered
gradient, every parameter after the last SGD step, and the buffers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

D, R, H = 16, 4, 4  # hidden, rank, heads


class Bottleneck(nn.Module):
    def __init__(self, d: int = D, r: int = R, inplace: bool = False) -> None:
        super().__init__()
        self.down = nn.Linear(d, r, bias=False)
        self.act = nn.SiLU(inplace=inplace)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(x)))


class _Base(nn.Module):
    def __init__(self, n: int = 3, inplace_act: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Bottleneck(inplace=inplace_act) for _ in range(n))
        self.head = nn.Linear(D, 8)


class ResidualMul(_Base):
    """``x.mul_(2.0)`` on the residual stream between two bottlenecks."""

    def forward(self, x):
        h = self.blocks[0](x)
        h.mul_(2.0)
        h = h + self.blocks[1](h)
        return self.head(h)


class ReluReused(_Base):
    """``y = F.relu(...) * c; y.relu_()`` and ``y`` read again.

    (Eager torch itself refuses ``relu_`` on relu's own output in training: relu
    saves its result for the backward.)
    """

    def forward(self, x):
        y = F.relu(self.blocks[0](x)) * 1.5
        y.relu_()
        return self.head(self.blocks[1](y) * y)


class AliasIadd(_Base):
    """``h = x; x += 1; h * 2``: the alias sees the write."""

    def forward(self, x):
        x = self.blocks[0](x)
        h = x
        x += 1
        return self.head(self.blocks[1](h * 2) + x)


class HiddenScale(_Base):
    """``y.mul_(hidden-sized constant)``: a buffer and a constant made in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, D))

    def forward(self, x):
        y = self.blocks[0](x)
        y.mul_(self.scale)
        y.mul_(torch.arange(D, dtype=y.dtype) / D + 0.5)
        return self.head(self.blocks[1](y))


class BlockIadd(_Base):
    """``h += block(h)``, twice.

    On one device torch refuses this program's backward, eagerly and under
    AOTAutograd alike (the block's first linear saved ``h`` for its weight
    gradient, and ``+=`` overwrote it). Its meaning is not in doubt, though, so
    the reference is the same model written ``h = h + block(h)``.
    """

    reference = False

    def forward(self, x):
        h = self.blocks[0](x)
        if self.reference:
            h = h + self.blocks[1](h)
            h = h + self.blocks[2](h)
        else:
            h += self.blocks[1](h)
            h += self.blocks[2](h)
        return self.head(h)


class ViewBeforeWrite(_Base):
    """A per-head view made before a write, read after it; writes through views."""

    def forward(self, x):
        h = self.blocks[0](x)
        b, s, _ = h.shape
        v = h.view(b, s, H, D // H)
        h.mul_(3.0)
        t = v.transpose(1, 2)
        t[:, :, 0] = 0.0  # a write through a view of a view: a sequence position
        out = self.blocks[1](v.reshape(b, s, D)) + h
        out[:, 1:3].mul_(0.5)  # a slice of the sequence, through getitem
        return self.head(out)


class InplaceModules(_Base):
    """``nn.SiLU(inplace=True)`` between the factors, ``F.relu(inplace=True)``, ``masked_fill_``."""

    def __init__(self) -> None:
        super().__init__(inplace_act=True)

    def forward(self, x):
        h = self.blocks[0](x)
        mask = torch.arange(h.shape[1]).view(1, -1, 1) % 3 == 0
        h.masked_fill_(mask, -1.0)
        F.relu(h, inplace=True)
        return self.head(self.blocks[1](h) + h)


class CopyInto(_Base):
    """``out.copy_(...)`` into a fresh tensor, ``zero_`` and ``fill_`` on activations."""

    def forward(self, x):
        h = self.blocks[0](x)
        out = torch.empty_like(h)
        out.copy_(h * 3)
        z = self.blocks[1](out)
        z[:, 0].zero_()
        z[:, -1].fill_(0.25)
        return self.head(z + out)


class BufferWrite(_Base):
    """A buffer written during the forward (a running statistic): handled exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x):
        h = self.blocks[0](x)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * h.detach().mean(dim=(0, 1)))
        return self.head(self.blocks[1](h))


class AllPatterns(_Base):
    """Every row above in one graph: the Inductor variant (one compile per rank)."""

    reference = False  # z += block(z): see BlockIadd

    def __init__(self) -> None:
        super().__init__(n=4, inplace_act=True)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, D))

    def forward(self, x):
        h = self.blocks[0](x)
        h.mul_(2.0)
        a = h
        a += 1
        b, s, _ = h.shape
        v = h.view(b, s, H, D // H)
        h.mul_(self.scale)
        h = self.blocks[1](v.reshape(b, s, D)) + h
        y = F.relu(h) * 1.5
        y.relu_()
        h[:, 0] = 0.0
        z = self.blocks[2](y) * y + h
        if self.reference:
            z = z + self.blocks[3](z)
        else:
            z += self.blocks[3](z)
        return self.head(z)


class WritesParameter(_Base):
    """Writes into a parameter during the forward: refused under TP (named error)."""

    def forward(self, x):
        self.blocks[0].up.weight.data.mul_(1.0)
        with torch.no_grad():
            self.head.weight.mul_(0.5)
        return self.head(self.blocks[0](x))


MODELS = {
    m.__name__: m
    for m in (
        ResidualMul, ReluReused, AliasIadd, HiddenScale, BlockIadd, ViewBeforeWrite,
        InplaceModules, CopyInto, BufferWrite, AllPatterns,
    )
}  # fmt: skip


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3)),)


def _gather(t: torch.Tensor, placement: Any, world: int) -> torch.Tensor:
    if not placement.is_shard:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return placement.unshard(parts)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def exact_training(
    name: str, lowering: str | None, *, world: int, mesh: Any, steps: int = 2
) -> dict[str, Any]:
    """``lowering``: None = parallelize's own (eager) path, else torch.compile's lowering."""
    import boost_compiler

    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    (x,) = _inputs()
    boost_compiler.parallelize(model, mesh, (x,))
    plan = model.boost_plan
    run = model
    if lowering is not None:
        run = torch.compile(model, backend="boost", options={"lowering": lowering})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    run_ref = ref
    if hasattr(ref, "reference"):
        ref.reference = True
    errs = {"out": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0, "buffer": 0.0}
    weights = None
    for step in range(steps):
        xs = x * (1 + step)  # fresh input values; the shape stays (no recompile)
        out, out_ref = run(xs), run_ref(xs)
        if weights is None:
            weights = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7))
        loss, loss_ref = (out * weights).sum(), (out_ref * weights).sum()
        errs["out"] = max(errs["out"], _rel(out.detach(), out_ref.detach()))
        errs["loss"] = max(errs["loss"], _rel(loss.detach(), loss_ref.detach()))
        opt.zero_grad()
        opt_ref.zero_grad()
        loss.backward()
        loss_ref.backward()
        for (pname, prm), (_, q) in zip(
            model.named_parameters(), ref.named_parameters(), strict=True
        ):
            if prm.grad is None or q.grad is None:  # an unused block: both must have none
                errs["grad"] = max(errs["grad"], float(prm.grad is not q.grad))
                continue
            g = _gather(prm.grad, plan.params[pname], world)
            errs["grad"] = max(errs["grad"], _rel(g, q.grad))
        opt.step()
        opt_ref.step()
    for (pname, prm), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        errs["param"] = max(
            errs["param"], _rel(_gather(prm.detach(), plan.params[pname], world), q)
        )
    for (_, b), (_, q) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        errs["buffer"] = max(errs["buffer"], _rel(b, q))
    return {**errs, "fallbacks": len(plan.fallbacks)}


def refuses_parameter_write(*, world: int, mesh: Any) -> dict[str, Any]:
    import boost_compiler

    torch.manual_seed(0)
    model = WritesParameter()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        boost_compiler.parallelize(model, mesh, _inputs())
    except boost_compiler.errors.MutationError as exc:
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return {"error_type": type(exc).__name__, "message": str(exc), "unchanged": unchanged}
    return {"error_type": None}
