"""One compile of the tiny CoLA-LLaMA with ``checkpoint=<mode>``, in its own process.

``python -m tests.checkpoint_probe MODE`` prints JSON: saved-activation bytes of
the compiled forward, the loss, a gradient checksum and the cache hit counters,
so a test can run it in fresh processes that share one Inductor cache dir.
"""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

from examples.cola_llama import build, example_inputs


def main(mode_arg: str) -> None:
    mode: bool | str = {"off": False, "on": True}.get(mode_arg, mode_arg)
    model = build("tiny", seed=7, n_layers=1)  # one layer: the compile dominates the test
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
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    print(
        json.dumps(
            {
                "saved": sum(saved.values()),
                "loss": loss.item(),
                "grads": grads.double().norm().item(),
                "hits": counters["aot_autograd"]["autograd_cache_hit"]
                + counters["inductor"]["fxgraph_cache_hit"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
