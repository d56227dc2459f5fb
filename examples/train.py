"""Pre-train the example CoLA-LLaMA with backend="boost": BTP x data parallel, resumable.

One process (no launcher)::

    python examples/train.py --steps 300 --metrics runs/tiny/metrics.jsonl

Tensor parallel over 2 processes, then 2 x 2 (FSDP2 across dp, BTP inside tp)::

    torchrun --standalone --nproc-per-node 2 examples/train.py --tp 2 --steps 300 \\
        --checkpoint-dir runs/tp2 --save-every 50 --metrics runs/tp2/metrics.jsonl
    torchrun --standalone --nproc-per-node 4 examples/train.py --tp 2 --dp 2 ...

Rerun the same command with ``--resume`` after a crash (or let torchrun restart it:
``--max-restarts 3`` with ``--resume``): training continues from the latest
complete checkpoint, at any (dp, tp). ``boost export --checkpoint runs/tp2 --out
model.safetensors`` writes the single-device weights. Same flags as ``boost train``.
"""

from __future__ import annotations

import argparse

from boost_compiler.cli.train import TRAIN


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    TRAIN.add_arguments(p)
    return TRAIN.run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
