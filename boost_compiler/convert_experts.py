"""``to_low_rank(..., experts=True)``: factor a MoE block's routed experts, expert by expert.

``transformers`` stores a MoE block's routed experts as two 3-D parameters,
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, and runs them as two grouped
GEMMs over the rows sorted by expert. :class:`LowRankExperts` replaces each expert's two
matrices by CoLA pairs of its own, in the layout :class:`~boost_compiler.convert.LowRankLinear`
uses per matrix (``down [r, d_in]``, ``up [d_out, r]``), stacked over the experts:

    gate_up_proj_down [E, r1, H]   gate_up_proj_up [E, 2I, r1]
    down_proj_down    [E, r2, I]   down_proj_up    [E, H, r2]

``r1`` and ``r2`` are ranks *per expert* (each expert's ``H -> 2I`` and ``I -> H`` map has
rank at most ``r1``, ``r2``), chosen by :func:`~boost_compiler.convert.to_low_rank`'s rule
from each per-expert matrix's ``min(d_in, d_out)``. The forward is ``transformers``'
grouped-GEMM forward with each GEMM replaced by two (``y = up_e(act(down_e(x)))`` for the
rows of expert ``e``; ``act`` SiLU for ``method="cola"``, none for ``"svd"``), so the compiler
sees four grouped GEMMs whose middle width is the rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .convert_rules import LayerConversion, choose_rank, covered, refuse_non_finite


def is_routed_experts(mod: nn.Module) -> bool:
    """``transformers``' routed experts in the one form :class:`LowRankExperts` reproduces:
    concatenated gate/up rows, ``[out, in]`` matrices, no bias, the default gate, no norm."""
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not isinstance(gu, nn.Parameter) or not isinstance(dn, nn.Parameter):
        return False
    if gu.dim() != 3 or dn.dim() != 3:
        return False
    e, two_i, h = gu.shape
    form = (getattr(mod, "has_gate", None), getattr(mod, "has_bias", None),
            getattr(mod, "is_transposed", None), getattr(mod, "is_concatenated", None),
            getattr(mod, "has_post_expert_norm", None))  # fmt: skip
    return (
        form == (True, False, False, True, False)
        and tuple(dn.shape) == (e, h, two_i // 2)
        and two_i % 2 == 0
        and _default_gate(mod)
    )


def _default_gate(mod: nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return getattr(type(mod), "_apply_gate", None) is _default_apply_gate


def _grouped(x: torch.Tensor, w_out_in: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [S, in] -> [S, out]`` with expert ``e``'s ``w [out, in]`` on its rows: the kernel
    ``transformers`` picks (``torch._grouped_mm`` in bf16, its fp32 fallback op otherwise),
    which the compiler's grouped-GEMM rule knows."""
    from transformers.integrations.moe import _grouped_mm

    return _grouped_mm(x, w_out_in.transpose(-2, -1), offs=offs)


class LowRankExperts(nn.Module):
    """Routed experts whose every expert's ``gate_up`` and ``down`` maps are CoLA pairs."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, ranks: tuple[int, int], *,
        act_fn: nn.Module, activation: str | None = "silu",
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        e, h, i, (r1, r2) = num_experts, hidden, inter, ranks
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i
        self.ranks = (r1, r2)

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        self.gate_up_proj_down, self.gate_up_proj_up = param(e, r1, h), param(e, 2 * i, r1)
        self.down_proj_down, self.down_proj_up = param(e, r2, i), param(e, h, r2)
        self.act: nn.Module = nn.SiLU() if activation == "silu" else nn.Identity()
        self.act_fn = act_fn  # the experts' own gate activation: act_fn(gate) * up

    @property
    def activation(self) -> str | None:
        return "silu" if isinstance(self.act, nn.SiLU) else None

    def _pair(self, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, offs: Any) -> Any:
        return _grouped(self.act(_grouped(x, down, offs)), up, offs)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # transformers' grouped_mm_experts_forward (no bias, no expert parallelism): rows
        # sorted by expert, cut by offs, weighted, put back in token order, summed over k.
        k, n, h = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        rows = hidden_states[perm // k]
        weights = top_k_weights.reshape(-1)[perm]
        # histc, not bincount: CPU's histc needs float input, as in transformers.
        ids = (
            expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
        )
        counts = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = self._pair(rows, self.gate_up_proj_down, self.gate_up_proj_up, offs).chunk(2, -1)
        out = self._pair(self.act_fn(gate) * up, self.down_proj_down, self.down_proj_up, offs)
        out = out * weights.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        return out[inv_perm].view(n, k, h).sum(dim=1).to(hidden_states.dtype)

    @classmethod
    def from_dense(cls, mod: nn.Module, ranks: tuple[int, int], method: str) -> LowRankExperts:
        """``mod``'s factored twin: truncated SVD of each expert's matrices (``"svd"``, no
        activation; exact at ``ranks = (min(2I, H), min(H, I))``) or CoLA's random init."""
        gu, dn = mod.gate_up_proj, mod.down_proj
        e, two_i, h = gu.shape
        new = cls(e, h, two_i // 2, ranks, act_fn=mod.act_fn,
                  activation="silu" if method == "cola" else None, device=gu.device,
                  dtype=gu.dtype)  # fmt: skip
        pairs = ((gu, new.gate_up_proj_down, new.gate_up_proj_up),
                 (dn, new.down_proj_down, new.down_proj_up))  # fmt: skip
        new.rel_errors = []  # per projection; None for cola
        with torch.no_grad():
            for w, down, up in pairs:
                err = _svd_factors(w, down, up) if method == "svd" else _cola_factors(w, down, up)
                new.rel_errors.append(err)
        for p in new.parameters():
            p.requires_grad_(gu.requires_grad)
        return new.train(mod.training)


def _svd_factors(w: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> float:
    """Each expert's ``w[e] [out, in] ~ up[e] @ down[e]``, split ``sqrt(S)`` to each side as
    ``convert._svd_init`` does; the relative Frobenius error over all experts."""
    w32 = w.detach().to(torch.float64 if w.dtype == torch.float64 else torch.float32)
    u, s, vh = torch.linalg.svd(w32, full_matrices=False)  # batched over the experts
    r = down.shape[1]
    root = s[:, :r].sqrt()
    up.copy_(u[:, :, :r] * root[:, None, :])
    down.copy_(root[:, :, None] * vh[:, :r])
    norm = torch.linalg.vector_norm(w32)
    err = torch.linalg.vector_norm(w32 - up.to(w32.dtype) @ down.to(w32.dtype))
    return float(err / norm) if norm > 0 else 0.0


def _cola_factors(w: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> None:
    # convert._cola_init per expert: Var(up @ down) = 1 / (d_in + d_out), Xavier's.
    (d_out, d_in), r = w.shape[1:], down.shape[1]
    std = math.sqrt((d_in + d_out) ** -0.5 / math.sqrt(r))
    nn.init.normal_(down, 0.0, std)
    nn.init.normal_(up, 0.0, std)


def plan_experts(
    routed: dict[str, nn.Module], include: list[str], exclude: list[str], rank: int | None,
    ratio: float, multiple_of: int, method: str, report: Any,
) -> list[tuple[str, nn.Module, tuple[int, int]]]:  # fmt: skip
    """The routed experts to factor, with ``(r1, r2)`` per expert; the rest in ``report.skipped``.

    Each per-expert matrix takes ``to_low_rank``'s rank rule on its own
    ``min(d_in, d_out)``: ``rank`` for both (``RankError`` if not below it), or
    ``rank_ratio`` of it rounded to ``multiple_of``. Nothing is modified here.
    """

    plan = []
    for name, mod in routed.items():
        if include and not covered(name, include):
            continue
        if pat := covered(name, exclude):
            report.skipped[name] = f"excluded by {pat!r}"
            continue
        e, two_i, h = mod.gate_up_proj.shape
        r1, why1 = choose_rank(f"{name}.gate_up_proj", h, two_i, rank, ratio, multiple_of)
        r2, why2 = choose_rank(f"{name}.down_proj", two_i // 2, h, rank, ratio, multiple_of)
        if r1 is None or r2 is None:
            report.skipped[name] = why1 or why2
            continue
        if method == "svd" and mod.gate_up_proj.is_meta:
            from .errors import ConversionError

            raise ConversionError(f"method='svd' needs the values of '{name}'s experts (on meta)")
        if method == "svd":
            for attr in ("gate_up_proj", "down_proj"):
                refuse_non_finite(f"{name}.{attr}", getattr(mod, attr))
        plan.append((name, mod, (r1, r2)))
    return plan


def convert_experts(
    name: str, mod: nn.Module, ranks: tuple[int, int], method: str, owners: list[Any]
) -> list[Any]:
    """Put ``mod``'s :class:`LowRankExperts` in its place; one report row per projection
    (FLOPs per routed row, i.e. per token and chosen expert)."""

    new = LowRankExperts.from_dense(mod, ranks, method)
    for parent, attr in owners:
        setattr(parent, attr, new)
    e, h, i = new.num_experts, new.hidden_dim, new.intermediate_dim
    rows = []
    for proj, (d_in, d_out), r, err in zip(("gate_up_proj", "down_proj"), ((h, 2 * i), (i, h)),
                                           ranks, new.rel_errors, strict=True):  # fmt: skip
        rows.append(LayerConversion(
            name=f"{name}.{proj}", kind="Experts", d_in=d_in, rank=r, d_out=d_out,
            params_before=e * d_in * d_out, params_after=e * r * (d_in + d_out),
            flops_before=2 * d_in * d_out, flops_after=2 * r * (d_in + d_out), rel_error=err,
        ))  # fmt: skip
    return rows


def experts_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every :class:`LowRankExperts` of ``model``: name -> its shape, ranks, activation (what
    :func:`rebuild_experts` needs on a fresh dense model; ``hf_io`` records it)."""
    return {
        name: {"num_experts": mod.num_experts, "hidden": mod.hidden_dim,
               "intermediate": mod.intermediate_dim, "ranks": list(mod.ranks),
               "activation": mod.activation}
        for name, mod in model.named_modules()
        if isinstance(mod, LowRankExperts)
    }  # fmt: skip


def experts_mismatch(mod: nn.Module | None, spec: dict[str, Any]) -> str | None:
    """Why ``mod`` cannot take factored experts of ``spec``'s shape, or None."""
    if mod is None or not is_routed_experts(mod):
        return f"{type(mod).__name__ if mod is not None else 'no module'}, not routed experts"
    e, two_i, h = mod.gate_up_proj.shape
    want = (spec["num_experts"], spec["hidden"], spec["intermediate"])
    if (e, h, two_i // 2) != want:
        return f"experts {e} x (hidden {h}, intermediate {two_i // 2}), not {want}"
    return None


def rebuild_experts(model: nn.Module, name: str, spec: dict[str, Any]) -> None:
    """Replace ``model``'s routed experts ``name`` (checked by :func:`experts_mismatch`) by
    empty factored experts of ``spec``'s ranks; values come from a state dict afterwards."""
    mod = model.get_submodule(name)
    e, two_i, h = mod.gate_up_proj.shape
    w = mod.gate_up_proj
    new = LowRankExperts(e, h, two_i // 2, tuple(spec["ranks"]), act_fn=mod.act_fn,
                         activation=spec["activation"], device=w.device, dtype=w.dtype)  # fmt: skip
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new.train(mod.training))
