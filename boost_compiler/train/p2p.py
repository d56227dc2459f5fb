"""What the pipeline's point-to-point ops send, measured where every schedule posts them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["P2PMeter"]


@dataclass
class P2PMeter:
    """Bytes the pipeline's point-to-point ops send, and seconds spent waiting on them.

    Patches the two module-level helpers every ``torch.distributed.pipelining``
    schedule calls (``_batch_p2p`` to post a batch of ops, ``_wait_batch_p2p`` to wait
    for it): measurement only, the ops themselves are unchanged.
    """

    sent_bytes: int = 0
    sends: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)  # shape, B, peer
    wait_s: float = 0.0

    @contextlib.contextmanager
    def watch(self) -> Iterator[P2PMeter]:
        from torch.distributed.pipelining import schedules

        post, wait = schedules._batch_p2p, schedules._wait_batch_p2p

        def counted_post(ops: list[dist.P2POp], desc: str | None = None) -> Any:
            for op in ops:
                if op.op in (dist.isend, dist.send):
                    nbytes = op.tensor.numel() * op.tensor.element_size()
                    self.sends.append((tuple(op.tensor.shape), nbytes, op.peer))
                    self.sent_bytes += nbytes
            return post(ops, desc=desc)

        def timed_wait(works: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return wait(works)
            finally:
                self.wait_s += time.perf_counter() - t0

        schedules._batch_p2p, schedules._wait_batch_p2p = counted_post, timed_wait
        try:
            yield self
        finally:
            schedules._batch_p2p, schedules._wait_batch_p2p = post, wait
