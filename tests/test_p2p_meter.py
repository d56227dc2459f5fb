"""The pipeline's P2P meter times its waits where they happen (issue 42, item 6b).

On the CPU (gloo) ``wait()`` blocks the host: the clock is right. On CUDA (NCCL)
``wait()`` returns at once and the compute stream waits: only CUDA events around it see
the stall. torch's schedule helpers are stand-ins here, and so are CUDA's events (this
machine has no GPU): what is checked is which clock the meter reads.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import schedules

from boost_compiler.train.p2p import P2PMeter

STALL_MS = 250.0  # what the stand-in events say the stream waited


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: Any = None

    def record(self, stream: Any) -> None:
        self.at = stream

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is end.at == "compute stream"
        return STALL_MS


def _one_step(meter: P2PMeter, tensor: torch.Tensor, wait_s: float) -> None:
    """Post one send of ``tensor`` and wait for it, through torch's schedule helpers."""
    with (
        mock.patch.object(schedules, "_batch_p2p", lambda ops, desc=None: ["work"]),
        mock.patch.object(schedules, "_wait_batch_p2p", lambda works: time.sleep(wait_s)),
        meter.watch(),
    ):
        works = schedules._batch_p2p([SimpleNamespace(op=dist.isend, tensor=tensor, peer=1)])
        schedules._wait_batch_p2p(works)


def test_cpu_waits_are_timed_on_the_clock() -> None:
    meter = P2PMeter()
    _one_step(meter, torch.zeros(4, 8), wait_s=0.05)
    assert meter.sent_bytes == 128 and meter.sends == [((4, 8), 128, 1)]
    assert 0.05 <= meter.wait_s < 1.0


def test_cuda_waits_are_timed_on_the_stream() -> None:
    with FakeTensorMode():
        on_gpu = torch.zeros(4, 8, device="cuda")
    meter = P2PMeter()
    with (
        mock.patch.object(torch.cuda, "Event", _Event),
        mock.patch.object(torch.cuda, "current_stream", lambda device: "compute stream"),
    ):
        _one_step(meter, on_gpu, wait_s=0.0)  # an NCCL wait returns at once
        assert meter.sent_bytes == 128
        assert meter.wait_s == STALL_MS / 1e3
