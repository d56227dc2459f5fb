"""Shared test set-up: one Inductor cache for the whole suite (and its subprocesses)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Set before torch is imported anywhere in the run: compiled tests share one
# cache, so the second compile of an identical graph costs seconds, not tens.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
# Ranks of the multi-process tests share 2 CI cores: let them compile one after
# another so later ranks reuse the kernels rank 0 compiled (option compile_in_turns).
os.environ.setdefault("BOOST_COMPILE_IN_TURNS", "1")
