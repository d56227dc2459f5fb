"""Time to the first compiled step against depth, per block and whole-model (issue 28 item 4).

    python benchmarks/first_step_depth.py                   # 2 and 8 layers, tp=2, cold
    python benchmarks/first_step_depth.py --layers 2,4,8 --size large

Per depth and per route (``compile_blocks`` on: each distinct decoder block planned,
rewritten and lowered once; off: the whole model as one graph), 2 fresh processes
parallelize the CoLA-LLaMA of ``--size`` and time ``torch.compile(model,
backend="boost")`` through the end of the first training step (forward, backward,
AdamW), each run with an empty Inductor cache: what a user's first step costs. The
table gives the slower rank's seconds and the ratio to the shallowest depth.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the spawned workers import this script as a module
    sys.path.insert(0, str(ROOT))

from boost_compiler.bench.analysis import SIZES  # noqa: E402
from boost_compiler.bench.harness import make_model, spawn  # noqa: E402


def first_step(*, rank: int, world: int, mesh: Any, spec: dict, blocks: bool) -> dict[str, Any]:
    """Spawned: parallelize, compile, one AdamW step; seconds for each part."""
    import dataclasses

    import boost_compiler

    spec_ = dataclasses.replace(SIZES["small"], **spec)
    model = make_model("boost", spec_)
    tokens = torch.randint(0, spec_.vocab, (spec_.batch, spec_.seq))
    t0 = time.perf_counter()
    boost_compiler.parallelize(model, mesh, (tokens,), {"labels": tokens},
                               options={"compile_blocks": blocks})  # fmt: skip
    t1 = time.perf_counter()
    compiled = torch.compile(model, backend="boost")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = compiled(tokens, labels=tokens)
    loss.backward()
    opt.step()
    t2 = time.perf_counter()
    loss = compiled(tokens, labels=tokens)  # a warm step, for scale
    loss.backward()
    opt.step()
    t3 = time.perf_counter()
    return {"parallelize_s": t1 - t0, "first_step_s": t2 - t1, "warm_step_s": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--layers", default="2,8")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")]
    t = Table(title=f"time to the first compiled step, size {args.size}, tp={args.tp}, cold "
              "Inductor cache (slower rank, s)", title_justify="left")  # fmt: skip
    for c in ("route", *(f"{n} layers" for n in depths), f"{depths[-1]} / {depths[0]}"):
        t.add_column(c, justify="right")
    for blocks in (True, False):
        cells = []
        for n in depths:
            spec = {**SIZES[args.size].as_dict(), "layers": n}
            with tempfile.TemporaryDirectory(prefix="boost_first_step_") as cache:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
                res = spawn("benchmarks.first_step_depth:first_step", args.tp,
                            {"spec": spec, "blocks": blocks}, timeout_s=1200, tag="depth")  # fmt: skip
            if "error" in res:
                print(res.get("traceback", res["error"]))
                return 1
            worst = max(r["first_step_s"] for r in res["per_rank"])
            print(f"compile_blocks={blocks} layers={n}: first step {worst:.1f} s "
                  f"(parallelize {max(r['parallelize_s'] for r in res['per_rank']):.1f} s, "
                  f"warm step {max(r['warm_step_s'] for r in res['per_rank']):.2f} s)",
                  flush=True)  # fmt: skip
            cells.append(worst)
        route = "per block" if blocks else "whole model"
        t.add_row(route, *(f"{c:.1f}" for c in cells), f"{cells[-1] / cells[0]:.2f}x")
    Console().print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
