"""``boost train`` in its own process, saving every batch it trains on (test_train_data.py).

``BATCH_LOG=DIR python -m tests.train_data_probe <boost train flags>`` runs
``examples/train.py``'s main (the flags of ``boost train``) with the loop's batch
method wrapped: the ``[batch / dp, seq]`` rows of step ``s`` on rank ``r`` are
written to ``DIR/rank<r>_step<s>.pt`` before the step trains on them, so a test
that SIGKILLs the process still has every batch it used. Runs under torchrun's
environment variables (RANK, WORLD_SIZE, ...) like the trainer itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from boost_compiler.train import setup


def main(argv: list[str], out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    original = setup.Run.batch

    def batch(self: setup.Run, step: int) -> torch.Tensor:
        ids = original(self, step)
        torch.save(ids.cpu(), out / f"rank{rank}_step{step}.pt")
        return ids

    setup.Run.batch = batch  # type: ignore[method-assign]
    from examples.train import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main(sys.argv[1:], Path(os.environ["BATCH_LOG"])))
