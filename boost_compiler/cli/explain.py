"""``boost explain MODEL --tp 2 --out boost-report``.

``MODEL`` is ``cola-llama:<preset>`` (the packaged CoLA-LLaMA), a folder with a Hugging Face
``config.json``, or the user's own ``module:function`` / ``file.py:function`` returning
``(model, example_inputs[, example_kwargs])``: :func:`boost_compiler.models.factories.resolve`.
A folder whose ``config.json`` needs code from it (``auto_map``, or a ``model_type``
transformers does not define) is refused before anything reads it
(:func:`boost_compiler.hf_io.refuse_remote_code`, which
``boost_compiler.from_pretrained`` applies too): boost never runs code from a model folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..explain.run import explain
from ..models.factories import load_factory, resolve
from . import Command

__all__ = ["EXPLAIN", "load_factory"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "factory", metavar="MODEL",
        help="cola-llama:<preset> (tiny, 60m, 1b, 7b, 40b), a Hugging Face config folder, "
        "or module:function / file.py:function returning (model, example_inputs) or "
        "(model, example_inputs, example_kwargs)",
    )  # fmt: skip
    p.add_argument("--tp", type=int, default=2, help="simulated tensor-parallel degree")
    p.add_argument(
        "--out", default="boost-report", help="output folder (report.html, plan.json, drawings)"
    )
    p.add_argument("--layer", default=None, help="the layer to draw, e.g. layers.3")
    p.add_argument("--off", action="append", default=[], metavar="PASS",
                   help="switch a pass off (repeatable), e.g. --off group_linears")  # fmt: skip
    p.add_argument("--rank-ratio", type=float, default=None,
                   help="Hugging Face folder: make the dense model low-rank first "
                   "(to_low_rank(model, RATIO, method='cola'))")  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    if (Path(args.factory) / "config.json").is_file():
        # Before transformers reads the folder: with ``auto_map`` it would ask on a terminal
        # whether to run the folder's Python files, and run them on "y".
        from ..hf_io import refuse_remote_code

        refuse_remote_code(args.factory)
    model, inputs, kwargs = resolve(args.factory, rank_ratio=args.rank_ratio)
    report = explain(model, inputs, tp=args.tp, out_dir=args.out,
                     example_kwargs=kwargs or None,
                     options={name: False for name in args.off}, layer=args.layer)  # fmt: skip
    Console().print(report)
    return 1 if report.errors else 0


EXPLAIN = Command(
    _arguments,
    _run,
    "Capture a model, find its bottlenecks, run every boost pass on a simulated "
    "tensor-parallel group and show what each pass did: bottleneck tree, plan, collectives "
    "per layer after each pass, cost vs the standard plan; writes OUT/report.html, the "
    "drawings and OUT/plan.json (which parallelize(..., plan=) forces).",
)
