"""The ``boost`` command line: ``boost <command> [options]``.

Commands live in :data:`COMMANDS`, name -> :class:`CommandSpec` (a one-line
help and the ``"module:attribute"`` of a :class:`Command`). Only the command
being run is imported and given its arguments, so a slow or broken command
module cannot slow down or break the others. To add one (``explain``,
``bench``, ``train``, ``export``), write a module with a ``Command`` object and
add one line to :data:`COMMANDS`; nothing else here changes.

A command's ``run`` returns the exit status; a :class:`~boost_compiler.errors.BoostError`
it raises is printed as ``boost <command>: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import BoostError

PROG = "boost"


@dataclass(frozen=True)
class Command:
    """One subcommand: how to add its arguments and how to run it."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


@dataclass(frozen=True)
class CommandSpec:
    target: str  # "package.module:attribute" of a Command
    help: str


COMMANDS: dict[str, CommandSpec] = {
    "cost": CommandSpec(
        "boost_compiler.cli.cost:COST",
        "per-layer TP communication, GEMM intensity and alpha-beta estimate (cost model)",
    ),
    "explain": CommandSpec(
        "boost_compiler.cli.explain:EXPLAIN",
        "what boost finds and what each pass does, on a simulated TP group; writes report.html",
    ),
    "bench": CommandSpec("boost_compiler.cli.bench:BENCH", "measured: boost vs DTensor TP"),
    "train": CommandSpec(
        "boost_compiler.cli.train:TRAIN",
        "pre-train CoLA-LLaMA or a Hugging Face model: DP x BTP, DCP checkpoints",
    ),
    "export": CommandSpec(
        "boost_compiler.cli.train:EXPORT",
        "training checkpoint -> single-device safetensors, or a Hugging Face folder",
    ),
}


def load_command(name: str) -> Command:
    module, _, attr = COMMANDS[name].target.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``selected``'s module is imported for its arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="boost-compiler: tensor parallelism for low-rank LLMs"
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, spec in COMMANDS.items():
        if name == selected:
            cmd = load_command(name)
            p = sub.add_parser(name, help=spec.help, description=cmd.description or spec.help)
            cmd.add_arguments(p)
            p.set_defaults(_run=cmd.run)
        else:
            sub.add_parser(name, help=spec.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected if selected in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BoostError as err:
        _tell_launcher(err)
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        _tell_launcher(err)
        raise


def _tell_launcher(err: BaseException) -> None:
    """The error in torchrun's error file, so its summary names it under "Root Cause"
    (without the file it says only the exit code; the other ranks are stopped by it)."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)


if __name__ == "__main__":
    sys.exit(main())
