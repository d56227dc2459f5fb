"""A MoE block's expert stretch copied as its own graph module, for the call that runs it.

``rules/expert_parallel.py`` replaces ``up grouped GEMM -> gate -> down grouped GEMM`` by
one call of ``tp_ops.expert_parallel_ffn``, which runs the stretch on the rank's experts.
Invariant: the copy computes what the stretch computed (the same nodes, copied in order,
its inputs as placeholders), and the source graph is only read, never changed: a rule
decides with it, and the applier installs the module (``apply.Applier._submodule``).
"""

from __future__ import annotations

import torch
import torch.fx as fx


def stretch_module(
    x: fx.Node,
    weights: tuple[tuple[fx.Node, fx.Node | None], ...],
    offs: fx.Node,
    nodes: list[fx.Node],
) -> fx.GraphModule:
    """``nodes`` (in order, the last the output) as their own graph ``(x, *weights, offs)``.

    ``weights``: each parameter, and the view the stretch reads it through (its
    ``transpose(-2, -1)``), copied too; None where the stretch reads the parameter itself.
    """
    graph = fx.Graph()
    env = {x: graph.placeholder("x")}
    env.update({prm: graph.placeholder(f"w_{i}") for i, (prm, _) in enumerate(weights)})
    env[offs] = graph.placeholder("offs")
    for _, view in weights:
        if view is not None:
            env[view] = graph.node_copy(view, env.__getitem__)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[nodes[-1]])
    return fx.GraphModule(torch.nn.Module(), graph)
