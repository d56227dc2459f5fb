"""``boost train`` in which one rank raises at a chosen step (a test's fault injection).

``python tests/train_fault_probe.py RANK STEP [boost train args...]`` (under torchrun):
rank ``RANK``'s ``train_step`` raises ``RuntimeError("injected fault ...")`` at step
``STEP``; every other rank trains as ``boost train`` does.
"""

from __future__ import annotations

import os
import sys

from boost_compiler.cli import main
from boost_compiler.train import loop


def _inject(rank: int, at: int) -> None:
    step_fn = loop.train_step

    def faulty(run, step):  # type: ignore[no-untyped-def]
        if step == at and int(os.environ.get("RANK", "0")) == rank:
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        return step_fn(run, step)

    loop.train_step = faulty


if __name__ == "__main__":
    _inject(int(sys.argv[1]), int(sys.argv[2]))
    sys.exit(main(["train", *sys.argv[3:]]))
