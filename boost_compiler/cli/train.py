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

from ..errors import TrainConfigError
from ..layouts import LAYOUTS
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


LAYOUT_FORMATS = tuple(LAYOUTS)
FORMATS = ("safetensors", "pt", "hf", *LAYOUT_FORMATS)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="a run's checkpoint folder (its latest step) or one DIR/step_N")  # fmt: skip
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="safetensors / pt: one state dict file; hf: a Hugging Face folder "
                   "(config.json with the low-rank layout, model.safetensors) that "
                   "boost_compiler.from_pretrained loads, for --hf-config / --init-from runs; "
                   f"{', '.join(LAYOUT_FORMATS)}: a folder in that project's own low-rank "
                   "layout (default: safetensors for a .safetensors name, else pt)")  # fmt: skip
    p.add_argument("--out", default=None,
                   help="model.safetensors, model.pt, or the folder for --format hf or a "
                   "layout")  # fmt: skip
    p.add_argument("out_path", nargs="?", default=None, metavar="OUT", help="the same as --out")
    p.add_argument("--overwrite", action="store_true",
                   help="--format hf or a layout: write into a folder that is not empty, "
                   "removing the model files an earlier export left there (configs, "
                   "safetensors; other files stay); never a training run's folder")  # fmt: skip


def _export_run(args: argparse.Namespace) -> int:
    from ..train.checkpoint import export

    outs = {o for o in (args.out, args.out_path) if o is not None}
    if len(outs) != 1:
        raise TrainConfigError("give the output once: --out OUT, or OUT")
    (out,) = outs
    # Without --format the suffix decides, as it always did (.safetensors, else torch.save).
    safetensors = out.endswith(".safetensors")
    fmt = args.format or ("safetensors" if safetensors else "pt")
    if fmt == "hf":
        from ..train.hf_model import export_hf

        info = export_hf(args.checkpoint, out, overwrite=args.overwrite)
    elif fmt in LAYOUT_FORMATS:
        from ..train.hf_model import export_layout

        info = export_layout(args.checkpoint, out, fmt, overwrite=args.overwrite)
    else:
        if (fmt == "safetensors") != safetensors:
            raise TrainConfigError(
                f"--format {fmt} and --out {out} disagree: safetensors files end in .safetensors"
            )
        info = export(args.checkpoint, out)
    Console().print(
        f"wrote {info['path']}: {info['tensors']} tensors, {info['numel']:,} parameters, "
        f"step {info['step']}"
    )
    return 0


TRAIN = Command(
    add_arguments,
    _train_run,
    "Pre-train the example CoLA-LLaMA, or a Hugging Face model (--hf-config, --init-from) "
    "made low-rank, with backend='boost': BTP inside --tp, FSDP2 across --dp, 1F1B pipeline "
    "stages across --pp, AdamW with warm-up + cosine, global-norm clipping, DCP checkpoints "
    "that load at any (pp, dp, tp). On the embedded corpus, or on --data files (.txt, "
    ".jsonl, .parquet) streamed, tokenized with --tokenizer, packed and resumed exactly. "
    "Under torchrun for several processes; alone for one. A lost rank stops every rank "
    "within --comm-timeout, naming it; the same command with --resume continues.",
)

EXPORT = Command(
    _export_arguments,
    _export_run,
    "Write a training checkpoint's model as one single-device state dict with the original "
    "parameter names (safetensors), loadable with strict=True; or, with --format hf, as a "
    "Hugging Face folder that boost_compiler.from_pretrained loads; or in another project's "
    f"low-rank layout (--format {', '.join(LAYOUT_FORMATS)}).",
)
