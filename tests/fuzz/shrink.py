"""Greedy minimisation of a failing spec (outside hypothesis: for specs found by the benchmark).

``minimize(world, spec, mode, same)`` tries smaller and simpler variants (an op
removed, a residual or checkpoint replaced by its body, a field set to its plain
value, the output made the stream itself) and keeps each one for which
``same(result)`` still holds, until none does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

Spec = dict[str, Any]

PLAIN = {
    "bias_down": False, "bias_up": False, "bias": False, "affine": False, "heads": 0,
    "qk_norm": None, "rope": False, "mid": "none", "style": "linear", "proj": "lowrank",
    "causal": False, "view": "shape", "keepdim": True, "swap": False, "fn": "none",
}  # fmt: skip


def _lists(spec: Spec) -> Iterator[list[Spec]]:
    """Every op list of the spec (top level and bodies), outermost first."""
    stack = [spec["ops"]]
    while stack:
        ops = stack.pop(0)
        yield ops
        stack += [op["body"] for op in ops if "body" in op]


def candidates(spec: Spec) -> Iterator[Spec]:
    n_lists = len(list(_lists(spec)))
    for li in range(n_lists):
        for i in range(len(list(_lists(spec))[li])):
            new = copy.deepcopy(spec)
            ops = list(_lists(new))[li]
            op = ops[i]
            if len(ops) > 1:
                del ops[i]
                yield new
            new = copy.deepcopy(spec)
            ops = list(_lists(new))[li]
            if "body" in ops[i]:
                ops[i : i + 1] = ops[i]["body"]
                yield new
            for key, plain in PLAIN.items():
                if key in op and op[key] != plain and not (key == "fn" and op["kind"] == "inplace"):
                    if key == "style" and op["kind"] == "res":
                        plain = "add"
                    new = copy.deepcopy(spec)
                    list(_lists(new))[li][i][key] = plain
                    yield new
            if op["kind"] == "attn" and op["kv"] != op["H"]:
                new = copy.deepcopy(spec)
                list(_lists(new))[li][i]["kv"] = op["H"]
                yield new
    if spec.get("out", {}).get("how", "h") != "h":
        yield {**copy.deepcopy(spec), "out": {"how": "h"}}
    if spec["b"] > 1:
        yield {**copy.deepcopy(spec), "b": 1}


def minimize(
    run: Callable[[Spec], dict[str, Any]],
    spec: Spec,
    same: Callable[[dict[str, Any]], bool],
    budget: int = 300,
    log: Callable[[str], None] = print,
) -> Spec:
    """The smallest variant of ``spec`` found for which ``same(run(variant))`` holds."""
    seen = {json.dumps(spec, sort_keys=True)}
    tries = 0
    progress = True
    while progress and tries < budget:
        progress = False
        for cand in candidates(spec):
            key = json.dumps(cand, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            tries += 1
            try:
                ok = same(run(cand))
            except Exception:  # noqa: BLE001 - a candidate the grammar cannot build
                ok = False
            if ok:
                spec = cand
                log(f"  shrunk ({tries} tries): {json.dumps(spec)}")
                progress = True
                break
            if tries >= budget:
                break
    return spec
