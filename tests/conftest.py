"""Shared test set-up: one Inductor cache for the whole suite, and no state left behind.

Order independence: ``_restore_process_state`` (autouse) snapshots, before every
test, the process-wide state a test can change (dynamo, Inductor and functorch
config, including ``fail_on_recompile_limit_hit`` that ``parallelize`` sets; the
torch RNG; the default dtype; grad mode; the torch thread count; the handlers,
level and propagation of the ``boost_compiler`` loggers) and puts it back after
the test, so no test passes on what an earlier one left. ``bash dev.sh test`` (CI)
runs the suite in a new order each time with pytest-randomly and prints the seed
(``BOOST_TEST_SEED=N`` replays it); a bare ``pytest`` keeps the file order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Set before torch is imported anywhere in the run: compiled tests share one
# cache, so the second compile of an identical graph costs seconds, not tens.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
# Ranks of the multi-process tests share 2 CI cores: let them compile one after
# another so later ranks reuse the kernels rank 0 compiled (option compile_in_turns).
os.environ.setdefault("BOOST_COMPILE_IN_TURNS", "1")


def _loggers() -> list[logging.Logger]:
    """``boost_compiler`` and every child logger created so far."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith("boost_compiler.")]
    return [logging.getLogger("boost_compiler"), *map(logging.getLogger, sorted(names))]


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    configs = [(c, c.get_config_copy()) for c in (dynamo_config, inductor_config, functorch_config)]
    rng = torch.get_rng_state()
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    logs = {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in _loggers()}
    yield
    for config, saved in configs:  # only what changed: load_config warns on deprecated keys
        now = config.get_config_copy()
        for key, value in saved.items():
            if now.get(key) is not value and now.get(key) != value:
                setattr(config, key, value)
    torch.set_rng_state(rng)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for lg in _loggers():
        handlers, level, propagate, disabled = logs.get(lg, ([], logging.NOTSET, True, False))
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
