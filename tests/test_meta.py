"""The 40B-shape CoLA-LLaMA parallelized on the meta device (fake process group, p=2).

Run in a fresh process (about 30 s, 0.5 GB). Per-rank parameter bytes are
computed from the single-device parameter shapes, independently of the plan:
every weight is split in half, the untied LM head too (the example call passes
``labels``, so the loss is in the graph and the head is vocabulary-parallel).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

_SCRIPT = r"""
import json, torch, torch.distributed as dist
import boost_compiler
from boost_compiler.tp.collectives import fake_process_group
from examples.cola_llama import build, example_inputs

with fake_process_group(2):
    with torch.device("meta"):
        model = build("40b")
    full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    (ids,) = example_inputs(model.cfg, batch=1, seq=64)
    ids = ids.to("meta")
    boost_compiler.parallelize(model, dist.group.WORLD, (ids,), {"labels": ids})
    print(json.dumps({
        "full": full,
        "local": sum(p.numel() * p.element_size() for p in model.parameters()),
        "meta": all(p.is_meta for p in model.parameters()),
        "replicated": sorted(n for n, pl in model.boost_plan.params.items() if not pl.is_shard),
        "bottlenecks": len(model.boost_plan.bottlenecks),
    }))
"""


def test_40b_parallelized_on_meta_holds_half_of_every_weight() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["replicated"] == [], res["replicated"]
    assert res["local"] == sum(res["full"].values()) // 2
    assert res["meta"] and res["bottlenecks"] == 7 * 48
