"""Whether a saved plan fits a model: the check ``parallelize(..., plan=)`` runs first.

Invariant: :func:`check_fits` refuses, by name and before anything is modified, every
placement the model cannot take (a parameter missing from the plan or unknown to the
model, another shape, a partial parameter, a split its size does not divide), and
:func:`check_blocks_fit` (after planning, before sharding) a blocked split that no fused
up factor reads. What passes reaches the planner as fixed placements, which the rules
handle exactly: a placement no rule can use is gathered, and the plan lists that gather
as a fallback (``tests/test_plan_forced.py`` trains random edits against one device).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..errors import PlanMismatchError
from ..tp.placement import P, Placement
from ..tp.plan import TPPlan


def check_fits(plan: TPPlan, shapes: Mapping[str, tuple[int, ...]], p: int) -> None:
    """Raise :class:`PlanMismatchError` naming every parameter ``plan`` cannot place.

    ``shapes``: the model's parameters (first name of each, as ``named_parameters()``).
    """
    if plan.p != p:
        raise PlanMismatchError(
            f"the plan is for tp={plan.p}, the mesh has {p} ranks: save a plan at tp={p} "
            "(boost explain --tp), or pass the matching mesh"
        )
    problems = [f"{n!r}: in the model, not in the plan" for n in shapes if n not in plan.params]
    problems += [f"{n!r}: in the plan, not in the model" for n in plan.params if n not in shapes]
    for name, pl in plan.params.items():
        if name in shapes:
            problems += _placement_problems(name, pl, shapes[name], plan.param_shapes, p)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PlanMismatchError(
            f"the plan{f' ({plan.forced_from})' if plan.forced_from else ''} does not fit "
            f"the model ({len(problems)} problem(s)); nothing was modified:\n  {shown}{more}"
        )


def _placement_problems(
    name: str, pl: Placement, shape: tuple[int, ...], planned: Mapping[str, tuple[int, ...]],
    p: int,
) -> list[str]:  # fmt: skip
    if name in planned and tuple(planned[name]) != tuple(shape):
        return [f"{name!r}: the plan's shape {list(planned[name])}, the model's {list(shape)}"]
    if pl == P:
        return [f"{name!r}: a parameter cannot be partial (P); write R or S(dim)"]
    if not pl.is_shard:
        return []
    if not 0 <= pl.dim < len(shape):
        return [f"{name!r}: {pl} names dim {pl.dim} of a {len(shape)}-d parameter {list(shape)}"]
    size = shape[pl.dim]
    if pl.blocks and sum(pl.blocks) != size:
        return [f"{name!r}: {pl}'s blocks sum to {sum(pl.blocks)}, dim {pl.dim} is {size}"]
    bad = [b for b in (pl.blocks or (size,)) if b % p]
    if bad:
        return [f"{name!r}: {pl} splits size {bad[0]} over p={p}, which does not divide it"]
    return []


def check_blocks_fit(plan: TPPlan, frozen: Collection[str] = ()) -> None:
    """A forced blocked split must be on a bottleneck's up factor or a ``frozen`` weight
    (run after planning).

    Only their contractions read a weight block by block (a fused q/k/v's pieces, each
    split over the ranks: ``rules/matrix._frozen`` for a frozen LoRA base); any other op
    would pair a blocked shard with a contiguous one (a frozen norm weight forced so is
    converted by the norm, ``rules/core.shard_arg``). Refused by name before the
    parameters are sharded.
    """
    ups = {b.up for b in plan.bottlenecks} | {b.up_bias for b in plan.bottlenecks if b.up_bias}
    ok = ups | set(frozen)
    bad = [f"{n!r}: {pl}" for n, pl in plan.params.items() if pl.blocks and n not in ok]
    if bad:
        raise PlanMismatchError(
            f"the plan{f' ({plan.forced_from})' if plan.forced_from else ''} splits "
            f"{len(bad)} parameter(s) in blocks that no fused up factor reads block by block "
            f"(only a bottleneck's up factor or a frozen weight can be); write S(dim) or R; nothing was "
            f"modified:\n  " + "\n  ".join(bad[:20])
        )
