"""How much of a perfect split two processes keep on this machine, with no communication.

    python benchmarks/split_ceiling.py [--tokens 1024 --d 512 --vocab 32000 --repeats 15]

Parallel efficiency ``T(1 process) / (p * T(p processes))`` charges a tensor-parallel system
for everything the p processes share: cores' caches, memory bandwidth, clock boost. This
measures that charge alone: the vocabulary-parallel head's GEMMs of ``boost bench``'s
``large-v32k`` (forward ``x @ W.T``, backward ``g @ W`` and ``g.T @ x``; at V=32,000 most of a
step) run by one process on all V columns, then by two processes at once, each on V/2 (the
split tensor parallelism makes, exact, with nothing exchanged). ``ceiling`` is their
parallel efficiency: no tensor-parallel system on this machine, with communication free and
every other part halved, exceeds it on these GEMMs. Each process: one thread, as in the bench.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp


def _head_step(x: torch.Tensor, w: torch.Tensor) -> None:
    z = x @ w.T
    g = torch.ones_like(z)  # stands in for the loss's gradient: same shape, same GEMMs
    _ = g @ w
    _ = g.T @ x


def _times(tokens: int, d: int, cols: int, repeats: int) -> list[float]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=gen)
    w = torch.randn(cols, d, generator=gen)
    _head_step(x, w)  # first touch of every buffer, outside the timing
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _head_step(x, w)
        out.append(time.perf_counter() - t0)
    return out


def _worker(barrier, queue, tokens: int, d: int, cols: int, repeats: int) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    barrier.wait()
    queue.put(_times(tokens, d, cols, repeats))


def _together(p: int, tokens: int, d: int, cols: int, repeats: int) -> list[float]:
    """Each of ``p`` processes' median time, all started at once."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(p), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(barrier, queue, tokens, d, cols, repeats))
        for _ in range(p)
    ]
    for proc in procs:
        proc.start()
    medians = [statistics.median(queue.get()) for _ in procs]
    for proc in procs:
        proc.join()
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="b * s (large-v32k: 4 * 256)")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    one = statistics.median(_times(a.tokens, a.d, a.vocab, a.repeats))
    alone_half = statistics.median(_times(a.tokens, a.d, a.vocab // a.p, a.repeats))
    split = _together(a.p, a.tokens, a.d, a.vocab // a.p, a.repeats)
    full_twice = _together(a.p, a.tokens, a.d, a.vocab, a.repeats)
    report = {
        "one process, all V (ms)": round(one * 1e3, 1),
        f"one process alone, V/{a.p} (ms)": round(alone_half * 1e3, 1),
        f"{a.p} processes at once, V/{a.p} each (ms, slowest)": round(max(split) * 1e3, 1),
        f"{a.p} processes at once, all V each (ms, slowest)": round(max(full_twice) * 1e3, 1),
        "ceiling: one / (p x slowest split)": round(one / (a.p * max(split)), 3),
        "alone V/p over one / p": round(alone_half * a.p / one, 3),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
