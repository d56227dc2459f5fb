"""Collectives started as early and waited for as late as the schedule allows (option
``overlap_comm``).

Invariant: Inductor's fused schedule is re-ordered, never changed: a topological order
of the same nodes (every data and ordering dependency Inductor recorded kept) in which,
among the nodes whose dependencies are met, a collective's start comes first, then the
nodes that feed a start not yet issued, then the rest in Inductor's order, and a
``boost::collective_wait`` last (only once nothing else can run). So the work that does
not depend on a collective (in backward, the weight-gradient GEMMs beside a down factor's
input-gradient all-reduce) runs while it is in flight. Every rank orders the same graph
the same way, so collectives are issued in one order on all ranks. The work moved in
between cannot be given a buffer the collective still reads or writes: each wait reads
its start's buffers (:mod:`.poll_waits`), so Inductor keeps them, for the collective
alone, until the wait.

It runs on Inductor's scheduler nodes after fusion (``_post_fusion_custom_pass``), not on
the FX graph: fusion sorts its fused kernels by their earliest member, which pulls a wait
back next to its start whenever a consumer of the wait fuses with earlier work (measured:
an FX-level order was undone in every backward layer). Inductor's peak-memory re-ordering,
which runs after it, is switched off where this pass is on (``backend.py``).
"""

from __future__ import annotations

import heapq
from typing import Any

from .poll_waits import STARTS, WAITS

_STARTS = frozenset(start for start, _ in STARTS.values())


def _op(snode: Any) -> Any:
    """The custom op a scheduler node runs, looking through a MultiOutput to its kernel."""
    node = getattr(snode, "node", None)
    op = getattr(node, "op_overload", None)
    if op is None and type(node).__name__ == "MultiOutput":
        op = getattr(node.inputs[0], "op_overload", None)
    return op


def _feeding(nodes: list[Any], deps: dict[Any, list[Any]]) -> set[Any]:
    """Every node a start depends on, transitively."""
    out: set[Any] = set()
    stack = [n for n in nodes if _op(n) in _STARTS]
    while stack:
        for d in deps[stack.pop()]:
            if d not in out:
                out.add(d)
                stack.append(d)
    return out


def reorder(nodes: list[Any]) -> list[Any]:
    """``nodes`` (a topological order) re-ordered as the module docstring says."""
    if not any(_op(n) in WAITS for n in nodes):
        return nodes
    by_buffer = {b: n for n in nodes for b in n.get_buffer_names()}
    deps = {  # ordered, each once: the producers in this list of what n still waits for
        n: list({by_buffer[d.name]: None for d in n.unmet_dependencies if d.name in by_buffer})
        for n in nodes
    }
    feeding = _feeding(nodes, deps)
    index = {n: i for i, n in enumerate(nodes)}

    def rank(n: Any) -> tuple[int, int]:
        op = _op(n)
        if op in _STARTS:
            return (0, index[n])
        if op in WAITS:
            return (3, index[n])
        return (1 if n in feeding else 2, index[n])

    users: dict[Any, list[Any]] = {n: [] for n in nodes}
    missing = {n: 0 for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            if d is not n:
                users[d].append(n)
                missing[n] += 1
    ready = [(rank(n), n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (rank(u), u))
    return order if len(order) == len(nodes) else nodes  # a cycle: Inductor's order stands
