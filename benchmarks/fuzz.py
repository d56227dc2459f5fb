"""Differential fuzzing of ``parallelize`` at tp=2 against one device (issue 13, part 5).

    python benchmarks/fuzz.py --programs 2000 --compiled 50        # the full run
    python benchmarks/fuzz.py --programs 30 --compile-eager 5      # a smoke run

Generates random single-device programs from ``tests/fuzz/grammar.py`` (hypothesis,
seeded by ``--seed``), runs each on a persistent 2-rank gloo world
(``tests/fuzz/world.py``): ``--compiled`` of them through ``torch.compile(backend=
"boost")`` with Inductor, ``--compile-eager`` with ``lowering="eager"``, the rest
eagerly (``model(x)``). Prints a line per program with the running counts, then a
table exact / named error / wrong (and invalid: the reference itself cannot run),
the failure classes, and writes every wrong spec (with its report) as JSON to
``--out`` (default: bench-results/fuzz/<timestamp>/, ignored by git like every run's output).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def generate(n: int, seed: int, max_ops: int = 5) -> list[dict[str, Any]]:
    """``n`` distinct specs drawn from the grammar's strategy, deterministically from ``seed``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from tests.fuzz.grammar import programs

    specs: dict[str, dict[str, Any]] = {}

    @hseed(seed)
    @settings(
        max_examples=n * 3, database=None, deadline=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(programs(max_ops=max_ops))
    def collect(spec: dict[str, Any]) -> None:
        if len(specs) < n:
            specs.setdefault(json.dumps(spec, sort_keys=True), spec)

    collect()
    return list(specs.values())[:n]


def failure_class(res: dict[str, Any]) -> str:
    """A failure's class: the stage and its message without numbers or names of values."""
    msg = res.get("error", "")
    msg = re.sub(r"max rel err \S+ at \S+; off: .*", "numbers off", msg)
    msg = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", msg)
    return f"{res.get('stage', '?')}: {msg[:120]}"


def rerun_files(paths: list[Path], timeout: float) -> int:
    from tests.fuzz.world import WRONG, World

    wrong = 0
    with World(timeout=timeout) as world:
        for path in paths:
            found = json.loads(path.read_text())
            res = world.run(found["spec"], found["mode"])
            wrong += res["outcome"] == WRONG
            print(f"{path.name}: {found['mode']} {res['outcome']} {res.get('stage', '')} "
                  f"{res.get('error', '')[:200]}", flush=True)  # fmt: skip
    print(f"{wrong} of {len(paths)} still wrong")
    return 1 if wrong else 0


def minimize_files(paths: list[Path], timeout: float) -> int:
    """Shrink each failing spec to a minimal one of the same failure class (printed, and
    written beside it as ``*.min.json``)."""
    from tests.fuzz.shrink import minimize
    from tests.fuzz.world import WRONG, World

    with World(timeout=timeout) as world:
        for path in paths:
            found = json.loads(path.read_text())
            mode, cls = found["mode"], failure_class(found["result"])
            print(f"{path}: {cls}", flush=True)

            def same(res: dict[str, Any], cls: str = cls) -> bool:
                return res["outcome"] == WRONG and failure_class(res) == cls

            small = minimize(lambda s, mode=mode: world.run(s, mode), found["spec"], same,
                             log=lambda m: print(m, flush=True))  # fmt: skip
            res = world.run(small, mode)
            path.with_suffix(".min.json").write_text(
                json.dumps({"spec": small, "mode": mode, "result": res}, indent=1)
            )
            print(
                f"minimal: {json.dumps(small)}\n  -> {res['outcome']} {res.get('stage', '')}: {res.get('error', '')}\n"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--compiled", type=int, default=0, help="of them through Inductor")
    ap.add_argument("--compile-eager", type=int, default=0, help='of them with lowering="eager"')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ops", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per program (a hang)")
    ap.add_argument("--out", type=Path, default=None, help="folder for failing specs")
    ap.add_argument("--quiet", action="store_true", help="print only failures and the table")
    ap.add_argument(
        "--minimize",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="shrink these failing specs (wrong-*.json) instead of fuzzing",
    )
    ap.add_argument(
        "--rerun",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="run these saved specs (wrong-*.json) again and print their outcome now",
    )
    args = ap.parse_args(argv)
    if args.rerun:
        return rerun_files(args.rerun, args.timeout)
    if args.minimize:
        return minimize_files(args.minimize, args.timeout)

    from tests.fuzz.world import EXACT, INVALID, NAMED, WRONG, World

    out = args.out or ROOT / "bench-results" / "fuzz" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    specs = generate(args.programs, args.seed, args.max_ops)
    n = len(specs)
    modes = ["eager"] * n
    # spread the compiled ones over the run, Inductor first in each stride
    for count, mode in ((args.compiled, "inductor"), (args.compile_eager, "compile_eager")):
        free = [i for i, m in enumerate(modes) if m == "eager"]
        if count and free:
            step = max(1, len(free) // count)
            for i in free[::step][:count]:
                modes[i] = mode
    counts: Counter[str] = Counter()
    per_mode: dict[str, Counter[str]] = {}
    classes: Counter[str] = Counter()
    named: Counter[str] = Counter()
    start = time.perf_counter()
    with World(timeout=args.timeout) as world:
        for i, (spec, mode) in enumerate(zip(specs, modes, strict=True)):
            res = world.run(spec, mode)
            kind = res["outcome"]
            counts[kind] += 1
            per_mode.setdefault(mode, Counter())[kind] += 1
            if kind == WRONG:
                cls = failure_class(res)
                classes[cls] += 1
                path = out / f"wrong-{i:05d}.json"
                path.write_text(json.dumps({"spec": spec, "mode": mode, "result": res}, indent=1))
            elif kind == NAMED:
                named[failure_class(res)] += 1
            line = (
                f"[{i + 1}/{n}] {mode:13s} {kind:11s} {res['seconds']:5.1f}s | exact {counts[EXACT]} "
                f"named {counts[NAMED]} wrong {counts[WRONG]} invalid {counts[INVALID]}"
            )
            if kind in (WRONG, NAMED):
                line += f" | {res.get('stage')}: {res.get('error', '')[:160]}"
            if not args.quiet or kind == WRONG:
                print(line, flush=True)
        restarts = world.restarts
    wall = time.perf_counter() - start
    print(f"\n{n} programs in {wall:.0f} s ({restarts} world restarts); failing specs in {out}")
    print(f"{'mode':14s} {'exact':>7s} {'named':>7s} {'wrong':>7s} {'invalid':>8s}")
    for mode, c in [*sorted(per_mode.items()), ("all", counts)]:
        print(f"{mode:14s} {c[EXACT]:7d} {c[NAMED]:7d} {c[WRONG]:7d} {c[INVALID]:8d}")
    if classes:
        print("\nwrong, by class:")
        for cls, k in classes.most_common():
            print(f"  {k:5d}  {cls}")
    if named:
        print("\nnamed errors, by class:")
        for cls, k in named.most_common():
            print(f"  {k:5d}  {cls}")
    (out / "summary.json").write_text(json.dumps({
        "programs": n, "seconds": wall, "counts": counts, "per_mode": per_mode,
        "wrong_classes": classes, "named_classes": named, "restarts": restarts,
    }, indent=1))  # fmt: skip
    return 1 if counts[WRONG] else 0


if __name__ == "__main__":
    sys.exit(main())
