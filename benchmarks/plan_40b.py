"""Planning the 40B CoLA-LLaMA on the meta device at tp=8: time and peak memory.

    python benchmarks/plan_40b.py [--max-seconds 30] [--max-rss-gb 1] [--tp 8]

``parallelize`` of CoLA-LLaMA "40b" (d=8192, 48 layers, r=2048) built on the meta
device, over torch's fake process group of ``--tp`` ranks, in a fresh process: capture,
detection, the sharding plan and every pass, then the plan's placements. Prints the wall
time of the planning alone (the model built first) and the process's peak resident
memory (interpreter and torch included), and exits non-zero over either bound (issue 27's
target: 30 s and 1 GB). The saved plan is checked to force the same placements.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = textwrap.dedent(
    """
    import json, os, resource, sys, tempfile, time, torch, torch.distributed as dist
    import boost_compiler
    from boost_compiler.models.cola_llama import build
    from boost_compiler.tp.groups import fake_process_group
    from boost_compiler.tp.plan import TPPlan
    tp = int(sys.argv[1])
    model = build("40b", device="meta")
    x = torch.zeros(1, 128, dtype=torch.long, device="meta")
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    with fake_process_group(tp):
        t0 = time.perf_counter()
        boost_compiler.parallelize(model, dist.group.WORLD, (x,))
        dt = time.perf_counter() - t0
        plan = model.boost_plan
        path = plan.save(os.path.join(tempfile.mkdtemp(), "plan.json"))
        same = TPPlan.load(path).params == plan.params
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"seconds": dt, "rss_gb": rss_gb, "rss_built_gb": rss_built,
                      "bottlenecks": len(plan.bottlenecks), "fallbacks": len(plan.fallbacks),
                      "collectives": len(plan.collectives), "plan_kb": path.stat().st_size / 1e3,
                      "reloads": same}))
    """
)


def plan_40b(tp: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, str(tp)], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--max-rss-gb", type=float, default=1.0)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    res = plan_40b(args.tp)
    print(
        f"40B meta plan at tp={args.tp}: {res['bottlenecks']} bottlenecks, {res['fallbacks']} "
        f"fallbacks, {res['collectives']} collectives; {res['seconds']:.1f} s, peak RSS "
        f"{res['rss_gb']:.2f} GB (after building the model {res['rss_built_gb']:.2f} GB); "
        f"plan.json {res['plan_kb']:.0f} kB, reloads to the same placements: {res['reloads']}"
    )
    over = []
    if res["seconds"] > args.max_seconds:
        over.append(f"{res['seconds']:.1f} s > {args.max_seconds} s")
    if res["rss_gb"] > args.max_rss_gb:
        over.append(f"{res['rss_gb']:.2f} GB > {args.max_rss_gb} GB")
    if not res["reloads"]:
        over.append("the saved plan does not reload to the same placements")
    if over:
        raise SystemExit("over the bound: " + ", ".join(over))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
