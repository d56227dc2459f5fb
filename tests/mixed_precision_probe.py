"""One 4-rank world for tests/test_mixed_precision.py: what each rank runs.

1. ``boost train``'s own ``train`` at tp=2 x dp=2, ``--mixed-precision bf16``: its losses
   and gradient norms (rank 0 writes the metrics file).
2. fp32, dp=4: per-block FSDP2 (``train.fsdp.shard``) against root-only ``fully_shard``,
   for a CoLA-LLaMA and a transformers Llama: the losses and the final parameters must be
   the same bits; and while the first block computes, the last one is still sharded
   (gathered per block), which under root-only wrapping it is not.
3. The bytes FSDP2's all-gathers and reduce-scatters moved, per step, in both, for the
   metrics' ``dp_collective_bytes`` (``train.fsdp.dp_bytes``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3


def rank_main(
    rank: int, world: int, port: int, out: str, train_kw: dict[str, Any], families: tuple[str, ...]
) -> None:
    """A rank with torchrun's environment; rank 0 writes ``out`` (JSON)."""
    fd = os.open(Path(out).with_suffix(f".rank{rank}.log"), os.O_WRONLY | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    from boost_compiler.train import TrainConfig, train

    dist.init_process_group("gloo")  # train() runs in this world, and leaves it to us
    t0 = time.monotonic()
    exact = {family: per_block_vs_root(family, out) for family in families}
    t1 = time.monotonic()
    with CountBytes() as moved:
        result = train(TrainConfig(**train_kw))
    record = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "dp_bytes_moved": moved.bytes / train_kw["steps"],
        "exact": exact,
        "seconds": {"exact": t1 - t0, "train": time.monotonic() - t1},
    }
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _model(family: str, folder: str) -> nn.Module:
    from boost_compiler.train import TrainConfig
    from boost_compiler.train.setup import build_model

    if family == "cola":
        return build_model(TrainConfig(model_overrides={"n_layers": 3}))
    import transformers as tf

    path = Path(folder).with_suffix(".hf")
    if dist.get_rank() == 0:
        config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, vocab_size=256)  # fmt: skip
        config.save_pretrained(path)
    dist.barrier()
    return build_model(TrainConfig(hf_config=str(path), seq=16))


def per_block_vs_root(family: str, folder: str) -> dict[str, Any]:
    """fp32 steps of the same model under both wrappings: (bitwise equal, per-block seen)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from boost_compiler.train import fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    runs = {}
    for how in ("root", "block"):
        model = _model(family, folder)
        seen: list[bool] = []
        # Runs after FSDP2's own pre-forward hook (it prepends): is the last block sharded?
        fsdp.blocks(model)[0].register_forward_pre_hook(_last_block_sharded(model, seen))
        if how == "root":
            fully_shard(model, mesh=mesh["dp"])
        else:
            fsdp.shard(model, mesh["dp"])
        with CountBytes() as moved:
            runs[how] = (_steps(model, family), seen)
    (losses_r, params_r), seen_r = runs["root"]
    (losses_b, params_b), seen_b = runs["block"]
    same = losses_r == losses_b and all(torch.equal(params_r[k], params_b[k]) for k in params_r)
    return {"bitwise": same, "losses": losses_b, "sharded_last_block": [seen_r[0], seen_b[0]],
            "dp_bytes": [moved.bytes / STEPS, fsdp.dp_bytes([model], 4, True, "none")],
            "units": sum(isinstance(b, torch.distributed.fsdp.FSDPModule)
                         for b in fsdp.blocks(model))}  # fmt: skip


class CountBytes:
    """FSDP2's all-gather outputs and reduce-scatter inputs, in bytes, while inside."""

    def __enter__(self) -> CountBytes:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

        self.bytes = 0
        self.saved = [(cls, cls.__call__) for cls in (coll.DefaultAllGather,
                                                      coll.DefaultReduceScatter)]  # fmt: skip
        for cls, call in self.saved:
            cls.__call__ = self._counting(call, gather=cls is coll.DefaultAllGather)
        return self

    def _counting(self, call: Any, gather: bool) -> Any:
        def counted(this: Any, *a: Any, **k: Any) -> Any:
            names = dict(zip(("output_tensor", "input_tensor"), a, strict=False)) | k
            full = names["output_tensor" if gather else "input_tensor"]
            self.bytes += full.numel() * full.element_size()
            return call(this, *a, **k)

        return counted

    def __exit__(self, *exc: Any) -> None:
        for cls, call in self.saved:
            cls.__call__ = call


def _last_block_sharded(model: nn.Module, seen: list[bool]) -> Any:
    from torch.distributed.tensor import DTensor

    last = fsdp_blocks(model)[-1]

    def hook(*_: Any) -> None:
        seen.append(isinstance(next(last.parameters()), DTensor))

    return hook


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    from boost_compiler.train.fsdp import blocks

    return blocks(model)


def _steps(model: nn.Module, family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())  # disjoint rows per dp rank
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (2, 16), generator=gen)
        out = model(ids, labels=ids)
        loss = out if family == "cola" else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.full_tensor() for k, v in model.state_dict().items()}
