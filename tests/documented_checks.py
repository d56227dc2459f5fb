"""Multi-rank checks for tests/test_documented_features.py (run by tests.tp_harness.run_world).

* :func:`compile_in_turns_off`: the tiny CoLA-LLaMA parallelized at tp=2 and compiled with
  Inductor under ``options={"compile_in_turns": False}`` (the suite's environment sets
  ``BOOST_COMPILE_IN_TURNS=1``, so the option must win over it): exact against one device,
  and the turn-taking path never ran.
* :func:`init_from_factors`: ``boost train --init-from``'s model build on every rank; with
  ``flip_rank1`` rank 1's SVD picks the other signs (a valid SVD too, what another LAPACK
  thread count may return); the parameters each rank ends with, as checksums.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.distributed as dist


def compile_in_turns_off(*, world: int, mesh: Any, steps: int = 2) -> dict[str, Any]:
    import boost_compiler
    from boost_compiler.options import BoostOptions
    from boost_compiler.parallel import runtime as backend
    from tests import models
    from tests.tp_harness import _training_result, probe_loss

    turns = {"n": 0}
    real = backend._in_turns

    def counted(*a: Any, **k: Any) -> Any:
        turns["n"] += 1
        return real(*a, **k)

    backend._in_turns = counted  # type: ignore[assignment]
    try:
        model, inputs = models.make_cola_llama()
        ref = copy.deepcopy(model)
        kw = {"labels": inputs[0]}
        boost_compiler.parallelize(model, mesh, inputs, kw)
        run = torch.compile(model, backend="boost", options={"compile_in_turns": False})

        def step(m: torch.nn.Module) -> Any:
            return (run if m is model else m)(*inputs, **kw)

        res = _training_result(model, ref, step, world=world, steps=steps, lr=0.1,
                               loss_of=probe_loss)  # fmt: skip
    finally:
        backend._in_turns = real  # type: ignore[assignment]
    default = BoostOptions.parse({}).settings["compile_in_turns"]
    res.pop("wire_fwd", None), res.pop("wire_bwd", None)
    return {**res, "turns": turns["n"], "default_in_turns": bool(default),
            "graphs": len(model.boost_plan.graphs)}  # fmt: skip


def _digest(model: torch.nn.Module) -> dict[str, str]:
    return {n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()[:16]
            for n, p in model.state_dict().items()}  # fmt: skip


def init_from_factors(folder: str, flip_rank1: bool, *, world: int, mesh: Any) -> dict[str, Any]:
    """The model ``boost train --init-from folder --tp 2`` builds, on this rank."""
    from boost_compiler.convert import LowRankLinear
    from boost_compiler.train import TrainConfig, hf_model

    real = hf_model._convert

    def convert(model: torch.nn.Module, cfg: Any, method: str) -> None:
        real(model, cfg, method)
        if flip_rank1 and dist.get_rank() == 1:  # the other signs of the same SVD
            with torch.no_grad():
                for mod in model.modules():
                    if isinstance(mod, LowRankLinear):
                        mod.down.weight.neg_()
                        mod.up.weight.neg_()

    hf_model._convert = convert  # type: ignore[assignment]
    try:
        model = hf_model.build(TrainConfig(init_from=folder, tp=2, seq=32))
    finally:
        hf_model._convert = real  # type: ignore[assignment]
    pairs = {n: m for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    first = sorted(pairs)[0]
    product = (pairs[first].up.weight @ pairs[first].down.weight).double()  # sign-free
    return {
        "digests": _digest(model),
        "n_factors": len(pairs),
        "first": first,
        "product_sum": float(product.sum()),
        "product_norm": float(product.norm()),
    }
