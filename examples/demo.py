"""The main job: find the bottlenecks of a CoLA-LLaMA and train it with backend="boost".

Builds the example CoLA-LLaMA, prints the bottlenecks the compiler finds from
the graph, then trains two copies from the same initialisation on the Python
standard library's sources (byte tokens): one eager, one through
``torch.compile(backend="boost")``, printing both losses side by side.

    python examples/demo.py --steps 30
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import boost_compiler
from boost_compiler.models.cola_llama import build
from boost_compiler.models.corpus import VOCAB_SIZE, random_batches, stdlib_corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="tiny", help="model preset (tiny, 60m, 1b, 7b, 40b)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="show the boost_compiler log")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        handlers=[RichHandler(console=console, show_path=False)],
        format="%(message)s",
    )
    torch.manual_seed(args.seed)
    model = build(args.config, seed=args.seed, vocab_size=VOCAB_SIZE, max_seq_len=max(args.seq, 64))
    n_params = sum(p.numel() for p in model.parameters())
    console.rule(
        f"[bold]boost-compiler demo[/]: CoLA-LLaMA '{args.config}', {n_params:,} parameters"
    )

    batches = random_batches(stdlib_corpus(), args.batch, args.seq, seed=args.seed)
    example = next(random_batches(stdlib_corpus(1 << 16), args.batch, args.seq))
    console.print(boost_compiler.bottleneck_table(boost_compiler.detect(model, (example,))))

    eager = model
    boosted = copy.deepcopy(model)
    compiled = torch.compile(boosted, backend="boost")
    opt_e = torch.optim.AdamW(eager.parameters(), lr=args.lr)
    opt_b = torch.optim.AdamW(boosted.parameters(), lr=args.lr)

    rows: list[tuple[int, float, float]] = []
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[losses]}"),
    )
    t0 = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("training (first step compiles)", total=args.steps, losses="")
        for step in range(args.steps):
            tokens = next(batches)
            losses = []
            for net, opt in ((eager, opt_e), (compiled, opt_b)):
                loss = net(tokens, labels=tokens)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            rows.append((step, *losses))
            progress.update(
                task,
                advance=1,
                description="training",
                losses=f"eager {losses[0]:.4f}  boost {losses[1]:.4f}",
            )
    elapsed = time.perf_counter() - t0

    table = Table(title="loss per step: eager vs backend='boost'", title_justify="left")
    for col in ("step", "eager", "boost", "rel. diff"):
        table.add_column(col, justify="right")
    shown = sorted({*range(0, args.steps, max(1, args.steps // 10)), args.steps - 1})
    worst = max(abs(b - e) / abs(e) for _, e, b in rows)
    for step, e, b in (rows[i] for i in shown):
        table.add_row(str(step), f"{e:.5f}", f"{b:.5f}", f"{abs(b - e) / abs(e):.1e}")
    console.print(table)
    console.print(
        f"{args.steps} steps in {elapsed:.1f}s (including compilation); "
        f"loss {rows[0][1]:.3f} → {rows[-1][1]:.3f}; largest eager/boost relative "
        f"difference {worst:.1e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
