"""The ``checkpoint`` pass on one process: fresh processes sharing a warm Inductor cache.

The order is the point: the cache is first filled by an UNtagged compile. A
cache key blind to the recompute tags would hand that graph to the tagged
request, and its saved bytes would not drop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe(mode: str, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_probe", mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkpoint_exact_smaller_and_cache_honest(tmp_path: Path) -> None:
    off = _probe("off", tmp_path)
    on = _probe("on", tmp_path)
    again = _probe("on", tmp_path)
    print(f"saved bytes: off {off['saved']:,}, on {on['saved']:,}, warm on {again['saved']:,}")
    assert on["saved"] < 0.6 * off["saved"]  # the tagged graph, not the cached untagged one
    assert again["hits"] > 0  # the third process really came from the cache...
    assert again["saved"] == on["saved"]  # ...and got the checkpointed graph
    from examples.cola_llama import build

    names = sorted(n for n, _ in build("tiny", seed=7, n_layers=1).named_parameters())
    # Every run against an untouched eager copy (not through the boost backend): the
    # loss, and each parameter's gradient element by element.
    for name, res in (("off", off), ("on", on), ("warm on", again)):
        worst = max(res["grad_errs"], key=res["grad_errs"].get)
        print(
            f"{name}: loss err {res['loss_err']:.1e}, grad err {res['grad_errs'][worst]:.1e} ({worst})"
        )
        assert res["loss_err"] <= 1e-5, name
        assert sorted(res["grad_errs"]) == names  # every parameter
        assert all(e <= 1e-5 for e in res["grad_errs"].values()), (name, res["grad_errs"])
