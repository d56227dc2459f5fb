"""The main job on 2 processes: BOOST tensor parallelism next to one device.

Every rank builds the same CoLA-LLaMA; ``parallelize`` shards it at the rank
dimension; the model trains through ``torch.compile(backend="boost")`` while
rank 0 also trains an unsharded copy on the same batches. Rank 0 prints both
losses and the collectives of one step with their payloads.

    torchrun --nproc-per-node 2 examples/demo_tp.py --steps 20
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh

import boost_compiler
from boost_compiler.models.cola_llama import build
from boost_compiler.models.corpus import VOCAB_SIZE, random_batches, stdlib_corpus


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    # A bounded wait: a rank that fails mid-step stops its peer in 5 minutes, not torch's 30.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    console = Console(quiet=rank != 0)
    mesh = init_device_mesh("cpu", (world,))
    model = build("tiny", seed=0, vocab_size=VOCAB_SIZE, max_seq_len=max(args.seq, 64))
    single = copy.deepcopy(model) if rank == 0 else None
    batches = random_batches(stdlib_corpus(), args.batch, args.seq, seed=0)
    first = next(batches)

    boost_compiler.parallelize(model, mesh, (first,), {"labels": first})
    plan = model.boost_plan
    console.rule(f"[bold]BOOST tensor parallelism, tp={world}[/]")
    console.print(plan.collective_table())
    compiled = torch.compile(model, backend="boost")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    opt_single = torch.optim.SGD(single.parameters(), lr=args.lr) if single else None

    table = Table(title=f"loss: one device vs tp={world} (backend='boost')", title_justify="left")
    for col in ("step", "one device", f"tp={world}", "rel. diff"):
        table.add_column(col, justify="right")
    tokens = first
    with console.status("training (the first step compiles)..."):
        for step in range(args.steps):
            loss = compiled(tokens, labels=tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if single is not None:
                ref = single(tokens, labels=tokens)
                opt_single.zero_grad(set_to_none=True)
                ref.backward()
                opt_single.step()
                rel = abs(loss.item() - ref.item()) / abs(ref.item())
                table.add_row(str(step), f"{ref.item():.5f}", f"{loss.item():.5f}", f"{rel:.1e}")
            tokens = next(batches)
    console.print(table)
    fwd = [c for c in plan.collectives if c.forward]
    bwd = [c for c in plan.collectives if c.backward]

    def nbytes(cs: list) -> int:
        return sum(int(torch.Size(c.global_shape).numel()) * c.dtype.itemsize for c in cs)

    console.print(
        f"collectives per step: {len(fwd)} forward ({nbytes(fwd):,} bytes), "
        f"{len(bwd)} backward ({nbytes(bwd):,} bytes); per-rank parameters "
        f"{sum(q.numel() for q in model.parameters()):,} of "
        f"{sum(torch.Size(s).numel() for s in plan.param_shapes.values()):,}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
