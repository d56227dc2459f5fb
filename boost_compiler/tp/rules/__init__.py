"""Per-op sharding rules, one module per op family, registered on import.

Invariant: importing this package registers every built-in rule with
:mod:`~boost_compiler.tp.rules.registry` (each family module registers its own
with ``@rule`` when it is imported), so the planner, which imports it, never
meets a kind whose built-in rule is missing. :data:`MODULES` lists the modules
whose source decides what a sharded graph computes (for cache keys).
"""

from __future__ import annotations

from . import (
    boundary,
    core,
    expert_parallel,
    experts,
    matrix,
    partial,
    pointwise,
    reductions,
    registry,
    slicing,
    views,
    vocab,
)

_ALL = (
    registry,
    core,
    pointwise,
    matrix,
    views,
    slicing,
    reductions,
    vocab,
    boundary,
    expert_parallel,
    experts,
    partial,
)
MODULES = tuple(m.__name__ for m in _ALL)
