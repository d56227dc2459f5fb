"""A user's own model for ``boost train --model tests.user_model:build`` (the third model
kind, train/spec_module.py): a tiny low-rank residual MLP language model, written as a
user would, as a ``LayeredLM`` so that ``--pp`` can cut it by layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from boost_compiler.models.cola_llama import LowRankLinear, RMSNorm
from boost_compiler.train import LayeredLM
from boost_compiler.train.config import TrainConfig
from boost_compiler.train.data import model_vocab


class Block(nn.Module):
    """``x + W2 silu(W1 norm(x))`` with both projections low-rank."""

    def __init__(self, d: int, hidden: int, rank: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d)
        self.inp = LowRankLinear(d, hidden, rank)
        self.out = LowRankLinear(hidden, d, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.silu(self.inp(self.norm(x))))


def build(cfg: TrainConfig) -> LayeredLM:
    """The model for the run ``cfg``: its ``[model]`` table may set d, layers, rank."""
    o = {"d": 32, "layers": 4, "rank": 8, **cfg.model_overrides}
    d, vocab = int(o["d"]), model_vocab(cfg) or 256
    embed = nn.Embedding(vocab, d)
    layers = [Block(d, 2 * d, int(o["rank"])) for _ in range(int(o["layers"]))]
    head = nn.Sequential(RMSNorm(d), nn.Linear(d, vocab, bias=False))
    return LayeredLM(embed, layers, head, d_model=d)
