"""Checks of tests/test_patterns.py: three model patterns that gathered before (issue 27, item 6).

A fused q/k/v projection viewed as ``(heads, 3, head_dim)`` and unbound per head; a fused
projection split into the queries and one shared key/value head (multi-query attention);
an ``nn.Linear`` subclass whose forward is ``x @ self.weight.T``, low-rank in some layers
only. Each in a small LM (embedding, blocks, head), 3 SGD steps at tp=2 against one device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import tp_harness as H

D, HEADS, R, V = 64, 4, 16, 256
HD = D // HEADS


class LowRank(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_in, R, bias=False)
        self.up = nn.Linear(R, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.silu(self.down(x)))


class HeadMajorQKV(nn.Module):
    """``qkv.view(b, s, heads, 3, head_dim).unbind(3)`` (GPT-NeoX's layout, per head)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = LowRank(D, 3 * D), LowRank(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, HEADS, 3, HD).unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, D))


class MultiQuery(nn.Module):
    """One fused projection into the queries and ONE key/value head shared by all heads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = LowRank(D, D + 2 * HD), LowRank(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([D, HD, HD], dim=-1)
        q = q.view(b, s, HEADS, HD).transpose(1, 2)
        k, v = (t.view(b, s, 1, HD).transpose(1, 2).expand(b, HEADS, s, HD) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, D))


class TransposeLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class TransposeMLP(nn.Module):
    def __init__(self, low_rank: bool) -> None:
        super().__init__()
        inner = R if low_rank else 4 * D
        self.down = TransposeLinear(D, inner, bias=False)
        self.up = TransposeLinear(inner, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(F.silu(self.down(x)))


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


PATTERNS = {
    "head_major_qkv": lambda: [HeadMajorQKV(), HeadMajorQKV()],
    "multi_query": lambda: [MultiQuery(), MultiQuery()],
    "x_at_weight_t": lambda: [TransposeMLP(True), TransposeMLP(False), TransposeMLP(True)],
}


def pattern(name: str, *, world: int, mesh: Any) -> dict[str, Any]:
    import boost_compiler

    torch.manual_seed(0)
    model = TinyLM(PATTERNS[name]())
    ref = copy.deepcopy(model)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    boost_compiler.parallelize(model, mesh, (ids,))
    plan = model.boost_plan

    def step(m: torch.nn.Module) -> Any:
        return m(ids)

    res = H._training_result(model, ref, step, world=world, steps=3, lr=0.1, loss_of=H.probe_loss)
    sharded = sorted(n for n, pl in plan.params.items() if pl.is_shard)
    return {"loss_err": res["loss_err"], "grad_err": res["grad_err"], "param_err": res["param_err"],
            "out_err": max(res["out_err"]), "fallbacks": list(plan.fallbacks),
            "bottlenecks": len(plan.bottlenecks), "sharded": sharded,
            "wire_fwd": [(n, s) for n, s, *_ in res["wire_fwd"]]}  # fmt: skip
