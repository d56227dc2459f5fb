"""``boost explain <module:factory> --tp 2 --out boost-report``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from ..cli import Command
from ..errors import BoostError
from .run import explain


def load_factory(spec: str) -> Any:
    """``pkg.module:fn`` or ``path/to/file.py:fn`` -> the function (cwd importable)."""
    target, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise BoostError(f"factory {spec!r} must look like 'module:function' or 'file.py:function'")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.exists():
            raise BoostError(f"factory file {target!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise BoostError(f"cannot import {target!r}: {err}") from err
    if not hasattr(module, attr):
        raise BoostError(f"{target!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("factory", help="module:function or file.py:function returning "
                   "(model, example_inputs) or (model, example_inputs, example_kwargs)")  # fmt: skip
    p.add_argument("--tp", type=int, default=2, help="simulated tensor-parallel degree")
    p.add_argument("--out", default="boost-report", help="output folder (report.html, drawings)")
    p.add_argument("--layer", default=None, help="the layer to draw, e.g. layers.3")
    p.add_argument("--off", action="append", default=[], metavar="PASS",
                   help="switch a pass off (repeatable), e.g. --off group_linears")  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    made = load_factory(args.factory)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise BoostError("the factory must return (model, example_inputs[, example_kwargs])")
    model, inputs, *rest = made
    report = explain(model, tuple(inputs), tp=args.tp, out_dir=args.out,
                     example_kwargs=rest[0] if rest else None,
                     options={name: False for name in args.off}, layer=args.layer)  # fmt: skip
    Console().print(report)
    return 1 if report.errors else 0


EXPLAIN = Command(
    _arguments,
    _run,
    "Capture a model, find its bottlenecks, run every boost pass on a simulated "
    "tensor-parallel group and show what each pass did: bottleneck tree, plan, collectives "
    "per layer after each pass, cost vs the standard plan; writes OUT/report.html and drawings.",
)
