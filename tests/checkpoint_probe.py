"""One compile of the tiny CoLA-LLaMA with ``checkpoint=<mode>``, in its own process.

``python -m tests.checkpoint_probe MODE`` prints JSON: saved-activation bytes of
the compiled forward, the cache hit counters, and the compiled step against an
untouched eager copy of the model (plain PyTorch, never through the boost
backend): the loss error and, per parameter, the largest element-wise gradient
difference relative to the reference's largest magnitude. A test runs it in
fresh processes that share one Inductor cache dir.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch._dynamo.utils import counters

from examples.cola_llama import build, example_inputs


def main(mode_arg: str) -> None:
    mode: bool | str = {"off": False, "on": True}.get(mode_arg, mode_arg)
    model = build("tiny", seed=7, n_layers=1)  # one layer: the compile dominates the test
    ref = copy.deepcopy(model)  # the reference: eager PyTorch, no boost anywhere
    (ids,) = example_inputs(model.cfg, batch=2, seq=64, seed=8)
    run = torch.compile(model, backend="boost", options={"checkpoint": mode})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(ids, labels=ids)
    loss.backward()
    loss_ref = ref(ids, labels=ids)
    loss_ref.backward()
    grad_errs = {
        name: ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    }
    print(
        json.dumps(
            {
                "saved": sum(saved.values()),
                "loss": loss.item(),
                "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
                "grad_errs": grad_errs,
                "hits": counters["aot_autograd"]["autograd_cache_hit"]
                + counters["inductor"]["fxgraph_cache_hit"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
