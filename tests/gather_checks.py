"""Checks of tests/test_gather_free.py: model patterns that gathered for no reason (issue 44).

Each pattern is written twice in a small 2-layer LM: as its authors write it (``x.square()``,
``y.view_as(x)``, ``q @ k.mT``, a rotary slice that is the whole head, one key/value head
expanded to every query head, a MoE's tokens copied per expert by ``repeat``, a LoRA update
merged into a weight computed in the forward) and the gather-free way (``x**2``, ``.view``,
``.transpose``, no slice, the unexpanded head, ``expand``, the update as its own GEMMs). At tp=2 each runs 3 SGD steps against one device, eager or
compiled, and reports its fallbacks, errors and the forward bytes on the wire per layer
(gloo's events on this rank, the second step, past any compile).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import tp_harness as H

D, HEADS, HD, R, V, LAYERS = 64, 4, 16, 16, 256, 2
EXPERTS = 4
ROPE = HD  # litgpt's rope_n_elem at rotary_percentage=1.0
_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


class LowRank(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_in, R, bias=False)
        self.up = nn.Linear(R, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.silu(self.down(x)))


class SquaredReLU(nn.Module):
    """A dense MLP whose activation is ``relu(x)`` squared, spelled three ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc, self.proj = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(x))
        h = {"method": lambda: h.square(), "torch": lambda: torch.square(h), "pow": lambda: h**2}[
            self.how
        ]()
        return x + self.proj(h)


def rotate_halves(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the last dim (fixed angles: enough to be a real computation)."""
    n, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / (10000 ** (torch.arange(0, n, 2, dtype=torch.float32) / n))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv).repeat(1, 2)
    x1, x2 = x[..., : n // 2], x[..., n // 2 :]
    return x * ang.cos() + torch.cat((-x2, x1), dim=-1) * ang.sin()


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs of the last dim, in complex form (Meta's Llama)."""
    n, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / (10000 ** (torch.arange(0, n, 2, dtype=torch.float32) / n))
    freqs = torch.polar(torch.ones(s, n // 2), torch.outer(torch.arange(s).float(), inv))
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal attention with ``n_kv`` key/value heads, the pattern picked by ``how``.

    ``view_as``/``view``: head split and merge; ``mT``/``transpose``: the score matmul;
    ``rope_slice``/``rope_whole``: rotary on ``x[..., :HD]`` (the whole head) or on ``x``;
    ``expand``/``repeat_interleave``/``repeat_kv``: how the ``n_kv`` heads reach every
    query head (``gqa``: sdpa's ``enable_gqa``, the unexpanded heads; ``halves``: the same
    with rotary on each head's halves).
    """

    def __init__(self, how: str, n_kv: int = HEADS) -> None:
        super().__init__()
        self.how, self.n_kv = how, n_kv
        self.qkv, self.o = LowRank(D, D + 2 * n_kv * HD), LowRank(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        how, n_kv = self.how, self.n_kv
        q, k, v = self.qkv(x).split([D, n_kv * HD, n_kv * HD], dim=-1)
        # A replicated shape donor: the view keeps q's shard on the heads (their local number).
        q = q.view_as(torch.empty(b, s, HEADS, HD)) if how == "view_as" else q.view(b, s, HEADS, HD)
        q = q.transpose(1, 2)
        k, v = (t.view(b, s, n_kv, HD).transpose(1, 2) for t in (k, v))
        if how == "rope_slice":  # rotary on the first ROPE of each head: here all of it
            q = torch.cat((_rotate_pairs(q[..., :ROPE]), q[..., ROPE:]), dim=-1)
            k = torch.cat((_rotate_pairs(k[..., :ROPE]), k[..., ROPE:]), dim=-1)
        elif how == "rope_whole":
            q, k = _rotate_pairs(q), _rotate_pairs(k)
        else:  # pairs, or the halves of each head (multi-query: of the one kv head, whole)
            rotate = rotate_halves if n_kv == HEADS or how == "halves" else _rotate_pairs
            q, k = rotate(q), rotate(k)
        rep = HEADS // n_kv
        gqa = {}
        if how == "expand":  # only for n_kv == 1
            k, v = (t.expand(b, HEADS, s, HD) for t in (k, v))
        elif how == "repeat_interleave":
            k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        elif how == "repeat_kv":  # HF's
            k, v = (
                t[:, :, None].expand(b, n_kv, rep, s, HD).reshape(b, HEADS, s, HD) for t in (k, v)
            )
        elif rep > 1:
            gqa = {"enable_gqa": True}
        if how in ("mT", "transpose"):
            kt = k.mT if how == "mT" else k.transpose(-2, -1)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            att = ((q @ kt) / math.sqrt(HD)).masked_fill(~mask, float("-inf"))
            y = att.softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        y = y.transpose(1, 2).contiguous()
        y = y.view_as(x) if how == "view_as" else y.view(b, s, D)
        return x + self.o(y)


class DenseMoE(nn.Module):
    """Every token through every expert (3-D weights, ``bmm``), weighted by the router; the
    tokens copied per expert by ``repeat`` or (gather-free) broadcast by ``expand``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, D, 2 * D) / D**0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, 2 * D, D) / (2 * D) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        n = h.shape[0]
        gates = self.router(h).softmax(dim=-1)
        if self.how == "repeat":
            xs = h.repeat(EXPERTS, 1).view(EXPERTS, n, D)
        else:
            xs = h.unsqueeze(0).expand(EXPERTS, n, D)
        y = torch.bmm(F.silu(torch.bmm(xs, self.w_in)), self.w_out)
        return x + (y * gates.t().unsqueeze(-1)).sum(0).view_as(x)


class MergedLoRA(nn.Module):
    """A dense MLP with a LoRA update on each weight: merged into a weight computed in the
    forward (``x @ (W + B @ A).T``), or (gather-free) applied as its own two GEMMs."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

        def lora(d_out: int, d_in: int) -> nn.ParameterList:
            return nn.ParameterList([torch.randn(d_out, d_in) / d_in**0.5,
                                     torch.randn(d_out, 4) * 0.1, torch.randn(4, d_in) / d_in**0.5])  # fmt: skip

        self.fc, self.proj = lora(4 * D, D), lora(D, 4 * D)

    def _project(self, x: torch.Tensor, w: nn.ParameterList) -> torch.Tensor:
        base, b, a = w
        if self.how == "merged":
            return x @ (base + b @ a).t()
        return F.linear(x, base) + F.linear(F.linear(x, a), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._project(F.relu(self._project(x, self.fc)), self.proj)


class TinyLM(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# name -> one layer (the model has LAYERS of them).
LAYER: dict[str, Callable[[], nn.Module]] = {
    "square": lambda: SquaredReLU("method"),
    "torch_square": lambda: SquaredReLU("torch"),
    "pow2": lambda: SquaredReLU("pow"),
    "view_as": lambda: Attention("view_as"),
    "view": lambda: Attention("view"),
    "mT": lambda: Attention("mT"),
    "transpose": lambda: Attention("transpose"),
    "rope_slice_mqa": lambda: Attention("rope_slice", n_kv=1),
    "rope_whole_mqa": lambda: Attention("rope_whole", n_kv=1),
    "mqa_expand": lambda: Attention("expand", n_kv=1),
    "mqa_repeat_interleave": lambda: Attention("repeat_interleave", n_kv=1),
    "mqa_repeat_kv": lambda: Attention("repeat_kv", n_kv=1),
    "mqa_gqa": lambda: Attention("gqa", n_kv=1),
    "mqa_halves": lambda: Attention("halves", n_kv=1),
    "gqa2_repeat_kv": lambda: Attention("repeat_kv", n_kv=2),
    "gqa2_repeat_interleave": lambda: Attention("repeat_interleave", n_kv=2),
    "gqa2": lambda: Attention("gqa", n_kv=2),
    "moe_repeat": lambda: DenseMoE("repeat"),
    "moe_expand": lambda: DenseMoE("expand"),
    "lora_merged": lambda: MergedLoRA("merged"),
    "lora_apart": lambda: MergedLoRA("apart"),
}


def fwd_bytes(events: list) -> int:
    """Bytes of the forward collectives on this rank's wire (each event's input)."""
    return sum(math.prod(shape) * _BYTES.get(dtype, 4) for _, shape, dtype in events)


def zoo(name: str, lowering: str | None, *, world: int, mesh: Any) -> dict[str, Any]:
    """3 SGD steps at tp=2 of the pattern ``name``; ``lowering``: compiled so, None: eager."""
    return train_layers(lambda: LAYER[name](), lowering, world=world, mesh=mesh)


def train_layers(layer: Any, lowering: str | None, *, world: int, mesh: Any) -> dict[str, Any]:
    """3 SGD steps at tp=2 of a TinyLM of LAYERS ``layer()`` against one device: errors,
    fallbacks and forward bytes per layer (``lowering``: compiled so, None: eager)."""
    import boost_compiler

    torch.manual_seed(0)
    model = TinyLM([layer() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    boost_compiler.parallelize(model, mesh, (ids,))
    plan = model.boost_plan
    run = model if lowering is None else H._compiled(model, lowering)

    def step(m: torch.nn.Module) -> Any:
        return (run if m is model else m)(ids)

    res = H._training_result(model, ref, step, world=world, steps=3, lr=0.1, loss_of=H.probe_loss)
    return {"loss_err": res["loss_err"], "grad_err": res["grad_err"], "param_err": res["param_err"],
            "out_err": max(res["out_err"]), "fallbacks": list(plan.fallbacks),
            "bytes_per_layer": fwd_bytes(res["wire_fwd"]) / LAYERS,
            "wire_fwd": res["wire_fwd"]}  # fmt: skip
