"""Compiled step time on 2 CPU processes: group_linears + online_norm on vs off, one run.

    python benchmarks/passes_step_time.py [--steps 10]

The reference decoder (d=256, d_ff=688, r=64, 2 layers, b=2, s=64, fp32); the two
configurations alternate step by step (same background load); median of ``--steps``
steps after 2 warm-up steps.
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
    from tests.tp_harness import run_world

    res = run_world(2, [("t", "passes_step_time", (), {"steps": args.steps})])["t"]
    if "error" in res:
        raise SystemExit(res["error"])
    on, off = res["median_s"]["on"], res["median_s"]["off"]
    print(f"passes on : {on * 1e3:8.1f} ms/step (median of {args.steps})")
    print(f"passes off: {off * 1e3:8.1f} ms/step")
    print(f"off / on  : {res['ratio_off_over_on']:.2f}x")


if __name__ == "__main__":
    main()
