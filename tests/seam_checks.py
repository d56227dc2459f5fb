"""Where the options meet: one compiled CoLA-LLaMA at tp=2 per graph-changing option.

Each check parallelizes the 2-layer tiny CoLA-LLaMA with the default ``compile_blocks``,
compiles it with one option set, and trains it two SGD steps against the single-device
model (:func:`tests.tp_harness._training_result`: outputs, losses, every gathered
gradient and parameter). What ran is read from the run itself, never from the plan:
the backward's gloo collectives of the second step (the profiler's events on the wire)
and whether the shadow the forward traced still holds its blocks as regions.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.tp_harness import _training_result, probe_loss


def compiled_with(options: dict[str, Any], *, world: int, mesh: Any) -> dict[str, Any]:
    """The tiny CoLA-LLaMA (2 layers) at tp=``world``, compiled with ``options``."""
    import boost_compiler
    from boost_compiler.models.cola_llama import build, example_inputs
    from boost_compiler.parallel.blocks import _MARK

    model = build("tiny", seed=5, n_layers=2)
    ref = copy.deepcopy(model)
    (ids,) = example_inputs(model.cfg, batch=2, seq=32, seed=6)
    parallel = {k: v for k, v in options.items() if k == "compile_blocks"}
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}, options=parallel or None)
    run = torch.compile(model, backend="boost", options=options)

    def step(m: torch.nn.Module) -> Any:
        return (run if m is model else m)(ids, labels=ids)

    res = _training_result(model, ref, step, world=world, steps=2, lr=0.1, loss_of=probe_loss)
    shadow = boost_compiler.parallel_state(model).shadow
    res["regions"] = sum(bool(getattr(type(m), _MARK, False)) for m in shadow.modules())
    res["bwd_collectives"] = len(res.pop("wire_bwd"))
    res["fwd_collectives"] = len(res.pop("wire_fwd"))
    return res
