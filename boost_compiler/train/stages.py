"""How a model's layers are cut into pipeline stages: one stage's share, and the split.

Kept apart from :mod:`.pipeline` (which runs the stages) so the stage modules of every
model family (:mod:`.pipeline_hf`) import it without importing the pipeline back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PipelineError


@dataclass(frozen=True)
class StageSpec:
    """One stage's share of the model: its index and the original layer indices it runs."""

    index: int
    num_stages: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def split_layers(n_layers: int, pp: int, counts: Sequence[int] | None = None) -> list[StageSpec]:
    """Stages of ``n_layers`` over ``pp``: ``counts`` layers each, else as even as possible.

    An uneven even split gives the extra layers to the middle stages first: the
    first and last stages also run the embedding and the (large) LM head.
    """
    if pp < 1:
        raise PipelineError(f"pp must be >= 1, got {pp}")
    if counts is None:
        base, extra = divmod(n_layers, pp)
        order = sorted(range(pp), key=lambda i: (i in (0, pp - 1), i))
        counts = [base + (1 if order.index(i) < extra else 0) for i in range(pp)]
    counts = list(counts)
    if len(counts) != pp or sum(counts) != n_layers or min(counts) < 0:
        raise PipelineError(
            f"layer counts {counts} must be {pp} non-negative numbers summing to {n_layers}"
        )
    if any(c == 0 for c in counts[1:-1]):
        raise PipelineError(f"layer counts {counts}: a middle stage without layers does nothing")
    out, start = [], 0
    for i, c in enumerate(counts):
        out.append(StageSpec(i, pp, tuple(range(start, start + c))))
        start += c
    return out
