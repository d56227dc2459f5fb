"""Checks of tests/test_plan_forced.py, run on every rank of one 2-process gloo world.

The tiny CoLA-LLaMA parallelized three ways from one set of weights: its own plan, that
plan saved and forced back (``parallelize(..., plan=path)``), and plans edited at random
(each parameter replicated or split on any dim its size allows). Each trains 3 SGD steps
against the single-device model; a check returns the errors, the collectives read off
the rewritten graphs and those gloo ran, or the named error a plan got instead.
"""

from __future__ import annotations

import copy
import json
import os
import random
import tempfile
from typing import Any

import torch

from tests import tp_harness as H


def _train(base: torch.nn.Module, mesh: Any, world: int, plan: Any = None) -> dict[str, Any]:
    """3 SGD steps of ``base`` parallelized (with ``plan`` forced) against one device.

    ``{"refused": ...}`` when ``parallelize`` raises a BoostError; an error anywhere later
    (a forced plan that was accepted and then failed) propagates: the check fails.
    """
    import boost_compiler
    from boost_compiler.errors import BoostError

    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    ids = _inputs(base)
    kw = {"labels": ids[0]} if hasattr(base, "cfg") else {}
    try:
        boost_compiler.parallelize(model, mesh, ids, kw or None, plan=plan)
    except BoostError as err:
        return {"refused": f"{type(err).__name__}: {err}"}

    def step(m: torch.nn.Module) -> Any:
        return m(*ids, **kw)

    res = H._training_result(model, ref, step, world=world, steps=3, lr=0.1, loss_of=H.probe_loss)
    p = model.boost_plan
    res["planned"] = [(c.kind, [str(s) for s in c.global_shape], c.forward, c.backward)
                      for c in p.collectives]  # fmt: skip
    res["params"] = {k: str(v) for k, v in p.params.items()}
    res["fallbacks"], res["forced_from"] = list(p.fallbacks), p.forced_from
    res["local_bytes"] = sum(t.numel() * t.element_size() for t in model.parameters())
    res["plan"] = p
    return res


def _inputs(base: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    from boost_compiler.models.cola_llama import example_inputs

    if hasattr(base, "cfg"):
        return tuple(example_inputs(base.cfg))
    return (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)


def _base(name: str = "cola") -> torch.nn.Module:
    """The tiny CoLA-LLaMA, or the GPT-2-style SVD model with every bias and a fused q/k/v."""
    from boost_compiler.models.cola_llama import build
    from tests.models import make_gpt2_svd

    torch.manual_seed(0)
    return build("tiny") if name == "cola" else make_gpt2_svd(down_bias=True)[0]


def _wire(res: dict[str, Any]) -> list[Any]:
    return [(name, shape) for name, shape, *_ in res["wire_fwd"] + res["wire_bwd"]]


def saved_and_forced(*, world: int, mesh: Any) -> dict[str, Any]:
    """The decided plan, saved, loaded and forced: the same collectives and the same numbers."""
    base = _base()
    decided = _train(base, mesh, world)
    path = os.path.join(tempfile.mkdtemp(prefix="boost-plan-"), "plan.json")
    decided["plan"].save(path)
    forced = _train(base, mesh, world, plan=path)
    keep = ("loss_err", "grad_err", "param_err", "losses", "params", "planned", "fallbacks",
            "forced_from", "local_bytes")  # fmt: skip
    out = {f"decided_{k}": decided[k] for k in keep} | {f"forced_{k}": forced[k] for k in keep}
    out["decided_wire"], out["forced_wire"] = _wire(decided), _wire(forced)
    out["forced_its_file"] = forced["forced_from"] == path  # each rank saved and read its own
    return out


def _random_plan(plan: Any, shapes: dict[str, tuple[int, ...]], p: int, rng: random.Random) -> dict:
    """Each parameter: R, S(d) on any dim its size allows, or the placement decided for it."""
    from boost_compiler.tp.placement import R, S

    data = plan.to_json()
    for name, entry in data["params"].items():
        shape = shapes[name]
        choices = [R] + [S(d) for d, size in enumerate(shape) if size % p == 0]
        entry["placement"] = rng.choice([str(c) for c in choices] + [entry["placement"]])
    return data


def edited_at_random(
    *, world: int, mesh: Any, model: str = "cola", plans: int = 6, seed: int = 0
) -> dict[str, Any]:
    """Plans no rule chose: every one trains exactly (none is refused: each placement fits)."""
    from boost_compiler.tp.plan import TPPlan

    base = _base(model)
    shapes = {n: tuple(t.shape) for n, t in base.named_parameters()}
    decided = _train(base, mesh, world)["plan"]
    rng = random.Random(seed)  # the same draws on every rank
    out: dict[str, Any] = {"runs": []}
    for i in range(plans):
        data = _random_plan(decided, shapes, world, rng)
        res = _train(base, mesh, world, plan=TPPlan.from_json(json.loads(json.dumps(data))))
        if "refused" in res:
            out["runs"].append({"plan": i, **res})
            continue
        out["runs"].append({
            "plan": i, "err": max(res["loss_err"], res["grad_err"], res["param_err"]),
            "sharded": sum(v.startswith("S") for v in res["params"].values()),
            "fallbacks": len(res["fallbacks"]),
            "drift": max(res["replica_drift"].values(), default=0.0),
        })  # fmt: skip
    return out
