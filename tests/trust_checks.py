"""Checks of tests/test_trust_compiler.py, run on every rank of one 2-process gloo world.

Models this project did not write, in the shapes public code gives them: a forward that
logs inside its loop over blocks (Hugging Face style), whose class something compiled
before ``parallelize``; a minGPT block that keeps its MLP as a lambda over its modules;
Meta's Llama with complex rotary embeddings. Each check returns what ran on its rank: the
errors against one device, the plan's fallbacks, the collectives gloo executed, or the
named error the model got instead.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests import tp_harness as H


class Block(nn.Module):
    def __init__(self, d: int = 32, r: int = 8) -> None:
        super().__init__()
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(torch.nn.functional.silu(self.down(h)))


class LoggingLM(nn.Module):
    """Hugging Face style: a deprecation notice through transformers' logger in the loop.

    The logger call is a graph break dynamo cannot resume from inside the loop, so the
    forward's own frame runs as Python; the head and ``scale`` are read in that frame.
    """

    def __init__(self, d: int = 32, vocab: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.utils import logging as hf_logging

        h = x
        for block in self.blocks:
            hf_logging.get_logger("trust_checks").warning_once("this block is deprecated")
            h = block(h)
        return self.head(h * self.scale)


def _logging_lm() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return LoggingLM(), (torch.randn(2, 8, 32),)


def _exact_or_refused(
    model: nn.Module, ref: nn.Module, inputs: tuple, mesh: Any, world: int
) -> dict:
    """``parallelize`` and 2 SGD steps against ``ref``; or the named error it raised."""
    import boost_compiler

    try:
        boost_compiler.parallelize(model, mesh, inputs)
        res = H._training_result(
            model, ref, lambda m: m(*inputs), world=world, steps=2, lr=0.1,
            loss_of=H.probe_loss,
        )  # fmt: skip
    except boost_compiler.errors.UncompiledFrameError as exc:
        return {"refused": f"UncompiledFrameError: {exc}"}
    return {**res, "fallbacks": model.boost_plan.fallbacks}


def skipped_frame(order: str, *, world: int, mesh: Any) -> dict[str, Any]:
    """Parallelize ``LoggingLM`` after ``order`` compiled its class (or nothing did)."""
    import boost_compiler

    model, inputs = _logging_lm()
    ref = copy.deepcopy(model)
    if order == "detect":
        boost_compiler.detect(_logging_lm()[0], inputs)
    elif order == "torch.compile":
        torch.compile(_logging_lm()[0], backend="eager")(*inputs)
    elif order == "second instance":
        first, _ = _logging_lm()
        out = _exact_or_refused(first, copy.deepcopy(first), inputs, mesh, world)
        if "refused" not in out:
            return {"refused": "", "first": out}  # the first must already be refused
    return _exact_or_refused(model, ref, inputs, mesh, world)


class Scale(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, d))

    @torch.compiler.disable
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.g


def disabled_submodule(*, world: int, mesh: Any) -> dict[str, Any]:
    """A submodule under ``torch.compiler.disable``: dynamo never compiles it."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Scale())
    x = torch.randn(2, 8, 32)
    return _exact_or_refused(model, copy.deepcopy(model), (x,), mesh, world)


class MinGPTBlock(nn.Module):
    """minGPT's MLP: a ModuleDict called through a lambda stored on the block."""

    def __init__(self, d: int = 32, r: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(d, r), c_proj=nn.Linear(r, d), act=nn.GELU(), dropout=nn.Dropout(0.0)
            )
        )
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlpf(self.ln(x))


def closure_model(*, world: int, mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(MinGPTBlock(), MinGPTBlock())
    x = torch.randn(2, 8, 32)
    ref = copy.deepcopy(model)  # its lambdas still name the original's modules: rebuild
    for blk in ref:
        m = blk.mlp
        blk.mlpf = lambda x, m=m: m.dropout(m.c_proj(m.act(m.c_fc(x))))
    out = _exact_or_refused(model, ref, (x,), mesh, world)
    out["bottlenecks"] = len(model.boost_plan.bottlenecks)
    return out


def meta_llama(*, world: int, mesh: Any) -> dict[str, Any]:
    from tests.meta_llama import make_meta_llama

    model, inputs = make_meta_llama()
    out = _exact_or_refused(model, copy.deepcopy(model), inputs, mesh, world)
    out["head"] = str(model.boost_plan.params["output.weight"])
    return out
