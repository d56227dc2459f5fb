"""``to_low_rank``: turn a dense model's projections into low-rank bottlenecks, in place.

Why a converter: BOOST's tensor parallelism only pays off on bottlenecks
``d_in -> r -> d_out``. Most users start from a dense model (their own, or a Hugging
Face one); this replaces each dense projection by a :class:`LowRankLinear`, two plain
``nn.Linear`` factors with an optional activation between them, which is exactly the
structure :func:`boost_compiler.detect` finds in the graph (no names, no special type).

Two initialisations:

* ``method="svd"``: the factors of the truncated SVD of the existing weight,
  ``down = sqrt(S_r) Vh_r``, ``up = U_r sqrt(S_r)``, no activation: the best rank-r
  approximation in Frobenius norm (Eckart-Young), for compressing a trained model.
* ``method="cola"``: CoLA's initialisation for pre-training, SiLU between the factors.
  Both factors are drawn ``N(0, s^2)`` with ``s^2 = (d_in + d_out)^(-1/2) / sqrt(r)``, so
  the product ``up @ down`` has entries of variance ``1 / (d_in + d_out)`` (Xavier's),
  i.e. the output variance of a dense layer with that init.

The embeddings and the output head stay dense by default (CoLA keeps them dense, and a
head tied to the embedding cannot be factored without untying it).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from .convert_heads import _dims, _heads
from .convert_rules import LayerConversion, refuse_non_finite
from .convert_rules import choose_rank as _choose_rank
from .convert_rules import covered as _covered
from .errors import ConversionError, PatternError, RankError, UnsupportedModuleError
from .parallel.shadow import is_shard, parallel_state
from .sparse import SparsePart

log = logging.getLogger("boost_compiler.convert")

__all__ = [
    "ConversionError",
    "ConversionReport",
    "LayerConversion",
    "LowRankLinear",
    "PatternError",
    "RankError",
    "UnsupportedModuleError",
    "low_rank_layout",
    "to_low_rank",
]

METHODS = ("cola", "svd")


class LowRankLinear(nn.Module):
    """``y = up(act(down(x)))``: the bottleneck that replaces a dense projection.

    Plain ``nn.Linear`` factors keep the state-dict layout obvious
    (``<name>.down.weight [r, d_in]``, ``<name>.up.weight [d_out, r]``, ``<name>.up.bias``)
    and give the compiler the ``d_in -> r -> d_out`` contraction pair it detects.
    ``sparse=True`` adds SLTrain's fixed-support sparse term beside the pair,
    ``y + x @ S^T`` (:class:`~boost_compiler.sparse.SparsePart`, ``<name>.sparse.weight``
    and ``<name>.sparse.mask``).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        *,
        bias: bool = True,
        activation: str | None = "silu",
        sparse: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = d_in, d_out, rank
        self.down = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
        self.act: nn.Module = nn.SiLU() if activation == "silu" else nn.Identity()
        self.up = nn.Linear(rank, d_out, bias=bias, device=device, dtype=dtype)
        self.sparse = SparsePart(d_in, d_out, device=device, dtype=dtype) if sparse else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(self.act(self.down(x)))
        return y if self.sparse is None else y + self.sparse(x)

    @property
    def activation(self) -> str | None:
        """``"silu"`` (CoLA) or ``None`` (SVD): the constructor's ``activation``."""
        return "silu" if isinstance(self.act, nn.SiLU) else None


def low_rank_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every :class:`LowRankLinear` of ``model``: name -> its shape, rank, bias, activation.

    What it takes to rebuild the same structure on a fresh dense model of the same
    architecture without running the conversion again (``boost_compiler.from_pretrained``
    reads it from a folder's ``config.json``): the factors' values come from the weights.
    """
    return {
        name: {"in_features": mod.in_features, "out_features": mod.out_features,
               "rank": mod.rank, "bias": mod.up.bias is not None, "activation": mod.activation,
               # Only where there is one: records of plain pairs stay as they were.
               **({"sparse": True} if mod.sparse is not None else {})}
        for name, mod in model.named_modules()
        if isinstance(mod, LowRankLinear)
    }  # fmt: skip


@dataclass
class ConversionReport:
    """What ``to_low_rank`` did; ``rich.print(report)`` shows it as a table."""

    method: str
    layers: list[LayerConversion] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it stayed dense
    model_params_before: int = 0
    model_params_after: int = 0

    @property
    def converted(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def params_before(self) -> int:
        return sum(layer.params_before for layer in self.layers)

    @property
    def params_after(self) -> int:
        return sum(layer.params_after for layer in self.layers)

    @property
    def flops_before(self) -> int:
        return sum(layer.flops_before for layer in self.layers)

    @property
    def flops_after(self) -> int:
        return sum(layer.flops_after for layer in self.layers)

    def table(self) -> Table:
        t = Table(
            title=f"to_low_rank ({self.method}): {len(self.layers)} layer(s) converted",
            title_justify="left",
        )
        svd = self.method == "svd"
        t.add_column("layer", no_wrap=True)
        t.add_column("kind")
        t.add_column("d_in → r → d_out", justify="right", no_wrap=True)
        t.add_column("params before → after", justify="right", no_wrap=True)
        t.add_column("FLOPs/token before → after", justify="right", no_wrap=True)
        if svd:
            t.add_column("‖W-UV‖/‖W‖", justify="right")
        for x in self.layers:
            row = [x.name, x.kind, f"{x.d_in} → [bold]{x.rank}[/] → {x.d_out}"]
            row += [_arrow(x.params_before, x.params_after), _arrow(x.flops_before, x.flops_after)]
            t.add_row(*row, *([f"{x.rel_error:.4f}"] if svd else []))
        total = ["total", "", "", _arrow(self.params_before, self.params_after)]
        total.append(_arrow(self.flops_before, self.flops_after))
        t.add_row(*total, *([""] if svd else []), style="bold")
        model = ["model, all parameters", "", ""]
        model += [_arrow(self.model_params_before, self.model_params_after), ""]
        t.add_row(*model, *([""] if svd else []), style="dim")
        return t

    def __rich__(self) -> Group | Table:
        if not self.skipped:
            return self.table()
        s = Table(title="kept dense", title_justify="left")
        s.add_column("module", no_wrap=True)
        s.add_column("why")
        for name, why in self.skipped.items():
            s.add_row(name, why)
        return Group(self.table(), s)


def _arrow(before: int, after: int) -> str:
    return f"{before:,} → {after:,}"


def _conv1d_type() -> type | None:
    """Hugging Face's GPT-2 ``Conv1D`` if transformers is installed (optional)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers absent or broken: nothing to convert of that kind
        return None
    return Conv1D


@functools.cache
def _linear_equivalents() -> tuple[type, ...]:
    """Subclasses of ``nn.Linear`` whose forward is ``nn.Linear``'s math, by exact type (an
    allowlist: a subclass's forward may do anything). Falcon's ``FalconLinear`` computes
    ``x @ W.T + b``, which ``F.linear`` is."""
    try:
        from transformers.models.falcon.modeling_falcon import FalconLinear
    except Exception:  # transformers absent, or Falcon gone from it
        return ()
    return (FalconLinear,)


def _dense_weight(mod: nn.Module, conv1d: type | None) -> torch.Tensor:
    """The weight as ``[d_out, d_in]`` whatever the layout."""
    w = mod.weight.detach()
    return w.t() if conv1d is not None and isinstance(mod, conv1d) else w


def _patterns(p: str | Sequence[str] | None) -> list[str]:
    return [p] if isinstance(p, str) else list(p or [])


def _named_explicitly(name: str, patterns: Sequence[str]) -> bool:
    return any(not any(c in pat for c in "*?[") and pat == name for pat in patterns)


def _cola_init(lr: LowRankLinear, d_in: int, d_out: int, r: int) -> None:
    # CoLA: std^2 = (d_in + d_out)^(-1/2) / sqrt(r) per factor, so that Var(up @ down) =
    # r * std^4 = 1 / (d_in + d_out), the Xavier variance of the dense layer it replaces.
    std = math.sqrt((d_in + d_out) ** -0.5 / math.sqrt(r))
    nn.init.normal_(lr.down.weight, 0.0, std)
    nn.init.normal_(lr.up.weight, 0.0, std)


def _svd_init(lr: LowRankLinear, w: torch.Tensor, r: int) -> float:
    """Set the factors from the truncated SVD of ``w [d_out, d_in]``; return the rel. error."""
    w32 = w.to(torch.float64 if w.dtype == torch.float64 else torch.float32)
    u, s, vh = torch.linalg.svd(w32, full_matrices=False)
    root = s[:r].sqrt()
    lr.up.weight.copy_(u[:, :r] * root)
    lr.down.weight.copy_(root[:, None] * vh[:r])
    approx = lr.up.weight.to(w32.dtype) @ lr.down.weight.to(w32.dtype)
    norm = torch.linalg.matrix_norm(w32)
    return float(torch.linalg.matrix_norm(w32 - approx) / norm) if norm > 0 else 0.0


def _param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def to_low_rank(
    model: nn.Module,
    *,
    rank: int | None = None,
    rank_ratio: float = 0.25,
    method: str = "cola",
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    multiple_of: int = 1,
    experts: bool = False,
) -> ConversionReport:
    """Replace ``model``'s dense projections by :class:`LowRankLinear` bottlenecks, in place.

    ``rank`` fixes r for every layer (a layer with ``r >= min(d_in, d_out)`` raises
    :class:`RankError`); otherwise ``r = floor(rank_ratio * min(d_in, d_out))`` rounded
    down to a multiple of ``multiple_of`` (use the TP degree, or 8 for tensor cores), and
    a layer where that is 0 stays dense. ``include``/``exclude`` are ``fnmatch`` patterns
    over module names; a pattern also matches a module's descendants (``"*.mlp"`` selects
    every projection inside each MLP). Converted: ``nn.Linear``, Hugging Face's
    ``Conv1D`` and Falcon's ``FalconLinear`` (other ``nn.Linear`` subclasses stay dense); with ``experts=True`` also ``transformers``' routed MoE experts, each
    expert's two matrices factored at a rank per expert
    (:mod:`boost_compiler.convert_experts`). Example::

        import rich, torch, boost_compiler
        from torch import nn

        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        report = boost_compiler.to_low_rank(model, method="svd", rank=16)
        rich.print(report)
        boost_compiler.detect(model, (torch.randn(2, 64),))  # two bottlenecks
    """
    _check_arguments(method, rank, rank_ratio, multiple_of)
    if parallel_state(model) is not None or any(map(is_shard, model.parameters())):
        raise ConversionError(
            f"{type(model).__name__} is parallelized, or a part of a parallelized model: "
            "call to_low_rank before parallelize"
        )
    inc, exc = _patterns(include), _patterns(exclude)
    conv1d = _conv1d_type()
    kinds = (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)
    modules = dict(model.named_modules())
    candidates = {n: m for n, m in modules.items() if n and isinstance(m, kinds)}
    routed = _routed_experts(modules) if experts else {}
    _check_patterns(model, modules, {**candidates, **routed}, inc, exc)

    report = ConversionReport(method=method, model_params_before=_param_count(model))
    heads = _heads(model, candidates, conv1d)
    plan: list[tuple[str, nn.Module, Any]] = []
    for name, mod in candidates.items():
        if inc and not _covered(name, inc):
            continue
        if pat := _covered(name, exc):
            report.skipped[name] = f"excluded by {pat!r}"
            continue
        parent = modules[name.rpartition(".")[0]]
        if isinstance(parent, LowRankLinear):
            continue  # already a factor: converting twice is a no-op
        explicit = _named_explicitly(name, inc)
        why = _why_dense(name, mod, parent, conv1d, heads, explicit)
        if why:
            if explicit:
                raise UnsupportedModuleError(f"cannot convert '{name}': {why}")
            report.skipped[name] = why
            continue
        _, d_in, d_out = _dims(mod, conv1d)
        r, why = _choose_rank(name, d_in, d_out, rank, rank_ratio, multiple_of)
        if r is None:
            report.skipped[name] = why
            continue
        if method == "svd" and mod.weight.is_meta:
            raise ConversionError(f"method='svd' needs the values of '{name}'s weight (on meta)")
        if method == "svd":
            refuse_non_finite(f"{name}.weight", mod.weight)
        plan.append((name, mod, r))

    if routed:
        from .convert_experts import plan_experts

        plan += plan_experts(routed, inc, exc, rank, rank_ratio, multiple_of, method, report)
    # Every check ran above: the model is only modified from here on.
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, pmod in model.named_modules(remove_duplicate=False):
        for cname, child in pmod.named_children():
            owners.setdefault(id(child), []).append((pmod, cname))
    for name, mod, r in plan:
        if isinstance(r, tuple):  # routed experts: a rank per expert for each projection
            from .convert_experts import convert_experts

            report.layers += convert_experts(name, mod, r, method, owners[id(mod)])
            continue
        report.layers.append(_convert_one(name, mod, r, method, conv1d, owners[id(mod)]))
    report.model_params_after = _param_count(model)
    log.info(
        "to_low_rank(%s): %d layer(s), %s -> %s parameters",
        method,
        len(report.layers),
        f"{report.model_params_before:,}",
        f"{report.model_params_after:,}",
    )
    return report


def _routed_experts(modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    from .convert_experts import is_routed_experts

    return {n: m for n, m in modules.items() if n and is_routed_experts(m)}


def _check_arguments(method: str, rank: int | None, rank_ratio: float, multiple_of: int) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if rank is None and not 0.0 < rank_ratio < 1.0:
        raise ValueError(f"rank_ratio must be in (0, 1), got {rank_ratio}")
    if rank is not None and rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    if rank is not None and rank % multiple_of:
        raise ValueError(f"rank {rank} is not a multiple of multiple_of={multiple_of}")


def _check_patterns(
    model: nn.Module,
    modules: dict[str, nn.Module],
    candidates: dict[str, nn.Module],
    include: Sequence[str],
    exclude: Sequence[str],
) -> None:
    """An include pattern must select a convertible module; an unused exclude is a warning."""
    for pat in include:
        hit = [n for n in modules if n and _covered(n, [pat])]
        if not hit:
            raise PatternError(
                f"include pattern {pat!r} matches no module of {type(model).__name__}"
            )
        if not any(n in candidates for n in hit):
            what = ", ".join(f"'{n}' ({type(modules[n]).__name__})" for n in hit[:5])
            raise UnsupportedModuleError(
                f"include pattern {pat!r} matches only modules to_low_rank cannot convert: "
                f"{what}; it converts nn.Linear, transformers' Conv1D and FalconLinear (and, with "
                "experts=True, transformers' routed MoE experts)"
            )
    for pat in exclude:
        if not any(n and _covered(n, [pat]) for n in modules):
            log.warning("exclude pattern %r matches no module", pat)


def _why_dense(
    name: str,
    mod: nn.Module,
    parent: nn.Module,
    conv1d: type | None,
    heads: dict[str, str],
    explicit: bool,
) -> str:
    """Why a candidate must stay dense ("" if it can be converted)."""
    if type(mod) not in (nn.Linear, conv1d, *_linear_equivalents()):
        return f"{type(mod).__name__} is a subclass of nn.Linear with its own behaviour"
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this weight directly, not through the module"
    if name in heads and (explicit is False or "tied" in heads[name]):
        return heads[name]
    return ""


def _convert_one(
    name: str,
    mod: nn.Module,
    r: int,
    method: str,
    conv1d: type | None,
    owners: list[tuple[nn.Module, str]],
) -> LayerConversion:
    kind, d_in, d_out = _dims(mod, conv1d)
    bias: Any = mod.bias
    w = mod.weight
    lr = LowRankLinear(
        d_in, d_out, r, bias=bias is not None,
        activation="silu" if method == "cola" else None, device=w.device, dtype=w.dtype,
    )  # fmt: skip
    err = None
    with torch.no_grad():
        if method == "svd":
            err = _svd_init(lr, _dense_weight(mod, conv1d), r)
        else:
            _cola_init(lr, d_in, d_out, r)
        if bias is not None:
            lr.up.bias.copy_(bias.detach())
    for p in lr.parameters():
        p.requires_grad_(w.requires_grad)
    lr.train(mod.training)
    for parent, attr in owners:
        setattr(parent, attr, lr)
    if r * (d_in + d_out) >= d_in * d_out:
        log.warning("'%s': rank %d saves no parameters (%d -> %d)", name, r, d_in, d_out)
    nb = int(bias.numel()) if bias is not None else 0
    return LayerConversion(
        name=name, kind=kind, d_in=d_in, rank=r, d_out=d_out,
        params_before=d_in * d_out + nb, params_after=r * (d_in + d_out) + nb,
        flops_before=2 * d_in * d_out, flops_after=2 * r * (d_in + d_out), rel_error=err,
    )  # fmt: skip
