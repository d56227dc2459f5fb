"""``explain``: what the compiler finds in a model and what each pass does to it.

Runs capture, bottleneck detection, planning and every pass of
:data:`boost_compiler.passes.PIPELINE` in ONE process on a simulated
tensor-parallel group of ``tp`` ranks (torch's fake process group: no ranks,
no communication, nothing modified in the model; meta-device models work).
After each pass it records the collectives of every layer and draws one
representative layer's graph and the whole model collapsed to one box per
layer (:mod:`.draw`). The :class:`Report` prints with rich and is written to
``out_dir`` as a self-contained ``report.html`` (:mod:`.html`: tables,
drawings), the drawings' ``.dot``/``.svg`` files and each stage's readable
graph code (``graphs/graph_<n>/``).

Command line: ``boost explain examples.factories:cola_llama_tiny --tp 2 --out boost-report``
(:mod:`.command`).
"""

from __future__ import annotations

from .result import CollectiveRow, CostRow, Report, Stage
from .run import explain

__all__ = ["CollectiveRow", "CostRow", "Report", "Stage", "explain"]
