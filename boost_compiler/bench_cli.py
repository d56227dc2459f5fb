"""``boost bench``: the measured benchmarks of ``benchmarks/bench.py``, as a CLI command.

The benchmark code lives in the repository's ``benchmarks/`` folder (with ``examples/``, whose
CoLA-LLaMA it trains), not in the installed package. This command finds that folder next to
the package (an editable install, as ``dev.sh`` makes) or in the current directory, puts the
repository root on ``sys.path`` and imports ``benchmarks.bench`` in-process: the arguments are
parsed once by this parser, errors come back as exceptions, and the spawned worker processes
import ``benchmarks._train`` by name (spawn passes ``sys.path`` on). A subprocess running
``python benchmarks/bench.py`` would work as well but re-imports torch once more and loses the
shared argument parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from .cli import Command
from .errors import BoostError

_MISSING = "_bench_missing"


class BenchError(BoostError):
    """boost bench cannot run: no source checkout (benchmarks/, examples/), or a bad argument."""


def find_root() -> Path:
    """The repository root holding ``benchmarks/bench.py`` and ``examples/``."""
    candidates = [Path(__file__).resolve().parents[1], Path.cwd()]
    for root in candidates:
        if (root / "benchmarks" / "bench.py").is_file() and (root / "examples").is_dir():
            return root
    raise BenchError(
        "boost bench needs a source checkout: benchmarks/bench.py and examples/ were found "
        f"neither beside the package nor in the current directory ({', '.join(map(str, candidates))}); "
        "install the package editable (pip install -e .) or run from the repository root"
    )


def load_bench() -> ModuleType:
    root = str(find_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.bench")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    try:
        bench = load_bench()
    except BenchError as err:
        p.set_defaults(**{_MISSING: str(err)})
        return
    bench.add_arguments(p)


def _run(args: argparse.Namespace) -> int:
    missing = getattr(args, _MISSING, None)
    if missing:
        raise BenchError(missing)
    try:
        return load_bench().run(args)
    except ValueError as err:  # a bad --sizes / --systems / --gemm-scales value
        raise BenchError(str(err)) from err


BENCH = Command(
    _add_arguments,
    _run,
    "Measured benchmarks: communication per training step (profiler gloo events, next to the "
    "cost model's prediction), compiled step time and tokens/s of BOOST vs torch DTensor TP "
    "(standard low-rank plan, dense model) vs one process (eager, inductor), and a GEMM "
    "microbench (K = r/p vs K = d/p). Writes bench-results/<timestamp>/ with results.json, "
    "tables.txt and PNG charts (matplotlib). Needs a source checkout (benchmarks/, examples/).",
)
