"""Per step and rank: the page faults a training step takes, beside its loss kernels' time.

    python benchmarks/step_faults.py                     # BOOST, large-v32k, tp=2, 1 thread
    python benchmarks/step_faults.py --system inductor --tp 1 --no-heap-reuse

Issue 45's why. A rank's loss kernels (the ``[N, V/p]`` passes of the vocabulary-parallel
cross-entropy) took 11-13 ms in some steps and 83-126 ms in others, on the same tree, with
nothing else running. The step's profile (``bench/breakdown.py``) gives each kernel's time;
``getrusage``'s minor-fault count around each step says whether the step touched memory the
process had not touched before. Without huge pages a slow step takes 16,000 faults: 65.5 MB
in 4 KiB pages, one ``[N, V/p]`` buffer at V=32,000, faulted in afresh, and each slow step
is exactly such a step. Every process starts as ``boost bench``'s do (``--thp``,
``--heap-reuse``), so the two switches can be tried one at a time.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the spawned workers import this script as a module
    sys.path.insert(0, str(ROOT))


def measure(
    *, rank: int, world: int, mesh: Any, system: str, size: str, steps: int
) -> dict[str, Any]:
    """Spawned: ``steps`` profiled steps of ``system`` after three warm-up steps; per step,
    its breakdown (``top`` included) and the minor faults the rank took during it."""
    import torch.distributed as dist

    from boost_compiler.bench import breakdown
    from boost_compiler.bench.analysis import SIZES
    from boost_compiler.bench.harness import ModelSpec
    from boost_compiler.bench.training import N_BATCHES, _System, make_model
    from boost_compiler.models.cola_llama import example_inputs

    ms = ModelSpec(**SIZES[size].as_dict())
    cfg = make_model("lowrank", ms).cfg
    batches = [example_inputs(cfg, batch=ms.batch, seq=ms.seq, seed=i)[0] for i in range(N_BATCHES)]
    barrier = dist.barrier if world > 1 else None
    with breakdown.kernel_events():  # compiled here: each Inductor kernel records an event
        run = _System(system, ms, world, mesh, 1e-3, batches)
        for i in range(3):
            if barrier is not None:
                barrier()
            run.step(i, record=False)
    faults: list[int] = []

    def step(i: int) -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run.step(i, record=False)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    profiled = breakdown.profile_steps(step, 3, steps, before=barrier)
    return {"rows": rows(profiled, faults)}


def rows(steps: list[dict[str, Any]], faults: list[int]) -> list[dict[str, float]]:
    """One row per profiled step: wall, minor faults, loss kernels, other compute, exposed
    comm (ms); the loss is the step's ``top`` names of kind "loss"."""
    from boost_compiler.bench.breakdown import kind_of

    out = []
    for st, n in zip(steps, faults, strict=True):
        loss = sum(ms for name, ms in st["top"].items() if kind_of(name) == "loss")
        out.append({"wall": st["wall_ms"], "faults": n, "loss": loss,
                    "other": st["other compute"], "comm": st["exposed comm"]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from boost_compiler.bench.harness import spawn
    from boost_compiler.bench.suite import process_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--system", default="boost", help="a boost bench system")
    ap.add_argument("--size", default="large-v32k")
    ap.add_argument("--tp", type=int, default=2, help="processes (1 for a one-process system)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--thp", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--heap-reuse", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    env = process_env(args)
    res = spawn("benchmarks.step_faults:measure", args.tp,
                {"system": args.system, "size": args.size, "steps": args.steps},
                timeout_s=1800, threads=1, tag="faults", env=env)  # fmt: skip
    if "error" in res:
        print(res.get("traceback", res["error"]))
        return 1
    con = Console()
    for r, got in enumerate(rank["rows"] for rank in res["per_rank"]):
        t = Table(title=f"{args.system}, {args.size}, rank {r} of {args.tp}, env {env}",
                  title_justify="left")  # fmt: skip
        for c in ("step", "wall ms", "minor faults", "loss kernels ms", "other ms", "comm ms"):
            t.add_column(c, justify="right")
        for i, row in enumerate(got):
            t.add_row(str(i), f"{row['wall']:.0f}", str(row["faults"]), f"{row['loss']:.1f}",
                      f"{row['other']:.0f}", f"{row['comm']:.0f}")  # fmt: skip
        t.caption = (f"median loss {statistics.median(x['loss'] for x in got):.1f} ms; "
                     f"median faults {statistics.median(x['faults'] for x in got):.0f}")  # fmt: skip
        con.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
