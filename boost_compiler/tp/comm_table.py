"""The one table of what each tensor-parallel primitive communicates, and its reader.

Invariant: every collective the compiler puts into a graph is a call of a
primitive registered in :data:`COMMUNICATION` (with :func:`communicates`, beside
the primitive in ``collectives.py`` or ``sharded_ops.py``), whose rows give the kind,
direction (forward, backward) and payload of each collective one call performs;
:func:`graph_collectives` reads a graph's collectives off its nodes through this
table, so the graph is their only record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx as fx

from ..ir.ops import value_of
from ..ir.subgraphs import body_of, is_call

#: ``(global shape, dtype)`` of one collective's payload at a node, or None when
#: the node does not communicate after all (a scatter of a tensor without grad).
Payload = Callable[[fx.Node], "tuple[tuple[Any, ...], torch.dtype] | None"]


@dataclass(frozen=True)
class Collective:
    """One collective a graph performs per call, for the plan, the cost model and explain.

    The payload (``global_shape``, ``dtype``) is the reduced or gathered tensor at
    its global size: the cost model's convention.
    """

    kind: str  # "all_reduce" | "all_gather"
    node: str
    global_shape: tuple[Any, ...]
    dtype: torch.dtype
    forward: bool  # communicates in the forward
    backward: bool  # communicates in the backward
    reason: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the payload at its global size (a symbolic size at its hint)."""
        return math.prod(int(s) for s in self.global_shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Comm:
    """One row of :data:`COMMUNICATION`: a collective each call of a primitive performs."""

    kind: str
    forward: bool
    backward: bool
    payload: Payload
    reason: str


#: Every primitive that communicates -> the collectives one call performs. Rows are
#: added by :func:`communicates`, beside the primitive they describe (here and in
#: ``sharded_ops.py``); a graph's collectives are whatever its nodes call from here.
COMMUNICATION: dict[Callable[..., Any], tuple[Comm, ...]] = {}

#: ``node.meta`` key a pass may set on a node it inserts to say why it communicates
#: (e.g. "vocab head"); the row's reason otherwise.
WHY_META = "boost_why"

_F = TypeVar("_F", bound=Callable[..., Any])


def communicates(*rows: Comm) -> Callable[[_F], _F]:
    """Register ``rows`` as what each call of the decorated primitive communicates.

    Registration happens when the primitive's module is imported, which is before
    any graph can call it: a table lookup never misses a primitive a node targets.
    """

    def register(fn: _F) -> _F:
        COMMUNICATION[fn] = rows
        return fn

    return register


def graph_collectives(graph: fx.Graph) -> list[Collective]:
    """The collectives ``graph`` performs per call, in node order: the only record of them.

    A primitive with a backward collective counts in both directions (one
    :class:`Collective` per row of :data:`COMMUNICATION`); a region call counts its
    body's, named ``call.node``.
    """
    found = []
    for node in graph.nodes:
        if is_call(node):  # a region call: its body's collectives, once per call
            found += [
                dataclasses.replace(c, node=f"{node.name}.{c.node}")
                for c in graph_collectives(body_of(node).graph)
            ]
            continue
        rows = COMMUNICATION.get(node.target, ()) if node.op == "call_function" else ()
        for row in rows:
            payload = row.payload(node)
            if payload is None:
                continue
            shape, dtype = payload
            why = node.meta.get(WHY_META) or row.reason
            found.append(
                Collective(row.kind, node.name, shape, dtype, row.forward, row.backward, why)
            )
    return found


def forward_communicating(node: fx.Node) -> bool:
    """Whether ``node`` calls a primitive that communicates in its forward."""
    rows = COMMUNICATION.get(node.target, ()) if node.op == "call_function" else ()
    return any(row.forward for row in rows)


def _payload_of(value: Any) -> tuple[tuple[Any, ...], torch.dtype] | None:
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def input_payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
    """The first argument's value: what an all-reduce sums."""
    return _payload_of(value_of(node.args[0]) if node.args else None)


def output_payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
    """The node's own value (a gather's result; a reduced sum)."""
    return _payload_of(value_of(node))


def grad_payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
    # A scatter is a slice; only a gradient flowing back makes it gather.
    v = value_of(node.args[0]) if node.args else None
    return _payload_of(v) if isinstance(v, torch.Tensor) and v.requires_grad else None


def statistics_payload(x_arg: int, width: Callable[[fx.Node], int]) -> Payload:
    """fp32 ``[..., width]`` per token of argument ``x_arg`` (kernels reduce statistics
    in fp32 whatever the activations' dtype)."""

    def payload(node: fx.Node) -> tuple[tuple[Any, ...], torch.dtype] | None:
        v = value_of(node.args[x_arg])
        if not isinstance(v, torch.Tensor):
            return None
        return (*v.shape[:-1], width(node)), torch.float32

    return payload
