"""The symbolic cost model: per-layer tensor-parallel communication, GEMM shapes and
alpha-beta estimates (``boost cost``, ``boost bench``, ``boost explain``).

:mod:`.formulas` holds the closed forms for LLaMA blocks under four strategies,
:mod:`.plans` the bytes of a plan ``parallelize`` built (to check the forms against) and of
pipeline stage boundaries, :mod:`.mla` the forms for multi-head latent attention.

**Two byte counts, and why they differ.** This package counts a collective's *payload*:
the size of the tensor all-reduced (all-gathered: the gathered tensor), independent of the
degree ``p``, as nccl-tests' "size" and BOOST's published tables do, so its numbers can be
compared with theirs. The planner's cost (:mod:`boost_compiler.tp.plan_cost`) counts the
*ring bytes* one rank sends, ``2(p-1)/p`` times the payload for an all-reduce and
``(p-1)/p`` for an all-gather or reduce-scatter, plus the FLOPs replicated work repeats,
because it weighs alternatives on one mesh by time. The two agree on which collectives a
plan runs and on their tensors; multiply a payload here by the ring factor to get the
planner's figure.
"""

from .formulas import *  # noqa: F403  (the public names of the closed forms)
from .mla import MLA_CONFIGS as MLA_CONFIGS
from .mla import MlaCost as MlaCost
from .mla import MlaDims as MlaDims
from .mla import mla_cost as mla_cost
from .plans import PipelineBoundary as PipelineBoundary
from .plans import PlanComm as PlanComm
from .plans import pipeline_boundary_bytes as pipeline_boundary_bytes
from .plans import plan_comm as plan_comm
