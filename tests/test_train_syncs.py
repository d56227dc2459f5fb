"""The trainer's per-parameter work, vectorised (issue 42, items 6c and 6d).

On a GPU every host read of a device value (``bool(t)``, ``.item()``) stalls the CPU until
the queue drains, and every small kernel costs a launch: the finite check before a save
reads the device once, and clipping issues a fixed number of kernels however many
parameters there are. Counted here with a dispatch mode, on the CPU: a host read is
``aten._local_scalar_dense``, a kernel is an aten call.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from boost_compiler.errors import DivergenceError
from boost_compiler.train import GradSlot, clip_grad_norm_
from boost_compiler.train.divergence import check_finite_parameters

SYNC = torch.ops.aten._local_scalar_dense.default


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def world_of_one() -> Iterator[None]:
    path = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group(backend=None, init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(params: dict[str, torch.Tensor]) -> Any:
    entries = [SimpleNamespace(name=n, param=p) for n, p in params.items()]
    return SimpleNamespace(layout=SimpleNamespace(entries=entries), device=torch.device("cpu"))


def test_finite_check_reads_the_device_once(world_of_one: None) -> None:
    params = {f"layers.{i}.w": torch.randn(4, 4) for i in range(6)}
    with _Ops() as ops:
        check_finite_parameters(_run(params), 3, None)
    assert ops.seen[SYNC] == 1, ops.seen


def test_finite_check_names_the_overflowed_parameters(world_of_one: None) -> None:
    params = {f"layers.{i}.w": torch.randn(4, 4) for i in range(3)}
    params["layers.1.w"][2, 2] = float("inf")
    with pytest.raises(DivergenceError, match=r"step 3: .*NaN/inf \(on this rank: layers\.1\.w;"):
        check_finite_parameters(_run(params), 3, None)


def _grads(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3, 5, generator=gen)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    return params


def test_clip_kernels_do_not_grow_with_the_parameters() -> None:
    counts = []
    for n in (3, 12):
        slots = [GradSlot(p, i % 2 == 0) for i, p in enumerate(_grads(n))]
        with _Ops() as ops:
            clip_grad_norm_(slots, 0.5)
        counts.append(sum(ops.seen.values()))
    assert counts[0] == counts[1], counts


def test_clipped_gradients_equal_torchs_sharded_and_replicated() -> None:
    """One device (no groups): both kinds of slot count once, as in torch's."""
    mine, ref = _grads(7, seed=1), _grads(7, seed=1)
    got = clip_grad_norm_([GradSlot(p, i < 3) for i, p in enumerate(mine)], 1.0)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert want > 1.0  # the clip did scale
    for p, q in zip(mine, ref, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
