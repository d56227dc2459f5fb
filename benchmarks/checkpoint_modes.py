"""Checkpoint off / lowrank / full on 2 CPU processes: saved bytes, collectives, step time.

    python benchmarks/checkpoint_modes.py [--steps 10]

CoLA-LLaMA d=256, d_ff=688, r=64, b=2, s=128, compiled with ``backend="boost"``.
Saved bytes per layer: what the compiled forward saves for the backward
(``saved_tensors_hooks``, parameters excluded), increment from 1 to 2 layers.
Backward collectives: gloo:* profiler events of one backward, and the count
in Inductor's backward graph. Step time: median of ``--steps`` steps, same run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    os.environ.setdefault("BOOST_COMPILE_IN_TURNS", "1")
    from rich.console import Console
    from rich.table import Table

    from tests.tp_harness import run_world

    res = run_world(2, [("c", "checkpoint_modes", (True,), {"steps_time": args.steps})])["c"]
    if "error" in res:
        raise SystemExit(res["error"])
    table = Table(title="checkpoint modes, tp=2 (b=2, s=128, d=256, r=64), compiled")
    for col in ("mode", "saved / layer", "vs off", "bwd collectives (gloo)", "bwd graph", "step"):
        table.add_column(col, justify="right")
    for mode, label in (("False", "off"), ("True", "lowrank"), ("full", "full")):
        per_layer = res.get(f"per_layer_{mode}")
        table.add_row(
            label,
            f"{per_layer:,} B" if per_layer is not None else "-",
            f"{per_layer / res['per_layer_False']:.0%}" if per_layer is not None else "-",
            str(res[f"bwd_collectives_{mode}"]),
            str(res[f"graph_collectives_{mode}"][-1]),
            f"{res[f'step_s_{mode}'] * 1e3:.1f} ms",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
