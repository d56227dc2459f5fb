"""Under torchrun: each rank builds the tiny CoLA-LLaMA from its own seed, as a script
without ``torch.manual_seed`` does, and trains it parallelized; rank 0 also trains its own
model alone and prints both loss curves as JSON (``tests/test_run_trust_procs.py``)."""

from __future__ import annotations

import copy
import datetime
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import boost_compiler
from boost_compiler.models.cola_llama import build, example_inputs


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    model = build("tiny", seed=100 + dist.get_rank(), n_layers=1)
    alone = copy.deepcopy(model)
    (ids,) = example_inputs(model.cfg, batch=2, seq=16, seed=1)
    boost_compiler.parallelize(model, init_device_mesh("cpu", (dist.get_world_size(),)), (ids,))
    tp = _train(model, ids)
    if dist.get_rank() == 0:
        print(json.dumps({"tp": tp, "rank0_alone": _train(alone, ids)}))
    dist.destroy_process_group()
