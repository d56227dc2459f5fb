"""What the pipeline's point-to-point ops send, measured where every schedule posts them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["P2PMeter"]


@dataclass
class P2PMeter:
    """Bytes the pipeline's point-to-point ops send, and seconds spent waiting on them.

    Patches the two module-level helpers every ``torch.distributed.pipelining``
    schedule calls (``_batch_p2p`` to post a batch of ops, ``_wait_batch_p2p`` to wait
    for it): measurement only, the ops themselves are unchanged. torch offers no public
    hook there (``tests/pipeline_checks.py`` runs the meter against torch's schedules).

    :attr:`wait_s` is what the waits cost where the work runs: on the CPU (gloo) the
    host blocks in ``wait()``, timed by the clock; on CUDA (NCCL) ``wait()`` returns at
    once and makes the compute stream wait instead, so the clock would read ~0: there a
    pair of CUDA events around each wait measures the stream's stall, read (a sync) only
    when :attr:`wait_s` is asked for.
    """

    sent_bytes: int = 0
    sends: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)  # shape, B, peer
    host_wait_s: float = 0.0
    stream_waits: list[tuple[Any, Any]] = field(default_factory=list)  # CUDA events
    _device: torch.device | None = None

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting for the pipeline's point-to-point ops (see the class)."""
        stalls = 0.0
        for start, end in self.stream_waits:
            end.synchronize()
            stalls += start.elapsed_time(end) / 1e3
        return self.host_wait_s + stalls

    @contextlib.contextmanager
    def watch(self) -> Iterator[P2PMeter]:
        from torch.distributed.pipelining import schedules

        post, wait = schedules._batch_p2p, schedules._wait_batch_p2p

        def counted_post(ops: list[dist.P2POp], desc: str | None = None) -> Any:
            for op in ops:
                self._device = op.tensor.device
                if op.op in (dist.isend, dist.send):
                    nbytes = op.tensor.numel() * op.tensor.element_size()
                    self.sends.append((tuple(op.tensor.shape), nbytes, op.peer))
                    self.sent_bytes += nbytes
            return post(ops, desc=desc)

        schedules._batch_p2p = counted_post
        schedules._wait_batch_p2p = lambda works: self._timed(wait, works)
        try:
            yield self
        finally:
            schedules._batch_p2p, schedules._wait_batch_p2p = post, wait

    def _timed(self, wait: Any, works: Any) -> Any:
        """``wait(works)``, timed on the clock or, for CUDA tensors, on their stream."""
        if self._device is not None and self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
            try:
                return wait(works)
            finally:
                end.record(stream)
                self.stream_waits.append((start, end))
        t0 = time.perf_counter()
        try:
            return wait(works)
        finally:
            self.host_wait_s += time.perf_counter() - t0
