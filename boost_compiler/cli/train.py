"""``boost train`` and ``boost export``: the training job and its checkpoint exporter.

``boost train`` runs in every process torchrun starts (``torchrun --nproc-per-node 4
$(which boost) train --tp 2``) or alone (one process, no launcher). ``boost export``
needs no ranks: it reads a DCP checkpoint in one process and writes the
single-device state dict.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from ..train.config import add_arguments, from_args
from . import Command


def _train_run(args: argparse.Namespace) -> int:
    from ..train.loop import configure_logging, train

    configure_logging()
    result = train(from_args(args))
    if result.losses:
        last = max(result.losses)
        Console(quiet=os.environ.get("RANK", "0") != "0").print(
            f"step {last}: loss {result.losses[last]:.4f}, {result.tokens_per_s:,.0f} tok/s (median)"
            + (f", checkpoint {result.checkpoint}" if result.checkpoint else "")
            + (f", curve {result.plot}" if result.plot else "")
        )
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="a run's checkpoint folder (its latest step) or one DIR/step_N")  # fmt: skip
    p.add_argument("--out", required=True, help="model.safetensors (or .pt for torch.save)")


def _export_run(args: argparse.Namespace) -> int:
    from ..train.checkpoint import export

    info = export(args.checkpoint, args.out)
    Console().print(
        f"wrote {info['path']}: {info['tensors']} tensors, {info['numel']:,} parameters, "
        f"step {info['step']}"
    )
    return 0


TRAIN = Command(
    add_arguments,
    _train_run,
    "Pre-train the example CoLA-LLaMA with backend='boost': BTP inside --tp, FSDP2 across "
    "--dp, AdamW with warm-up + cosine, global-norm clipping, DCP checkpoints that load at "
    "any (dp, tp). On the embedded corpus, or on --data files (.txt, .jsonl, .parquet) "
    "streamed, tokenized with --tokenizer, packed and resumed exactly. Under torchrun for "
    "several processes; alone for one.",
)

EXPORT = Command(
    _export_arguments,
    _export_run,
    "Write a training checkpoint's model as one single-device state dict with the original "
    "parameter names (safetensors), loadable with strict=True.",
)
