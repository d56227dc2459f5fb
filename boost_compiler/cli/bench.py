"""``boost bench``: the measured benchmarks of :mod:`boost_compiler.bench.suite`, as a command.

Everything it runs ships inside the package (the CoLA-LLaMA of
:mod:`boost_compiler.models.cola_llama`, torch's DTensor baselines, the GEMM microbench), so
it works from an installed wheel in any folder. The suite is imported in-process: the
arguments are parsed once by this parser, errors come back as exceptions, and the spawned
worker processes import ``boost_compiler.bench.training`` by name.
"""

from __future__ import annotations

import argparse

from ..errors import BenchError
from . import Command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench import suite

    suite.add_arguments(p)


def _run(args: argparse.Namespace) -> int:
    from ..bench import suite

    try:
        return suite.run(args)
    except ValueError as err:  # a bad --sizes / --systems / --gemm-scales value
        raise BenchError(str(err)) from err


BENCH = Command(
    _add_arguments,
    _run,
    "Measured benchmarks: communication per training step (profiler gloo events, next to the "
    "cost model's prediction), compiled step time and tokens/s of BOOST vs torch DTensor TP "
    "(standard low-rank plan, dense model) vs one process (eager, inductor), and a GEMM "
    "microbench (K = r/p vs K = d/p). Writes bench-results/<timestamp>/ with results.json, "
    "tables.txt and PNG charts (matplotlib: the [bench] extra).",
)
