"""Optional dependencies in tests: skipped only where the set-up did not promise them.

``bash dev.sh test`` (what CI runs) installs every extra the suite uses and sets
``BOOST_REQUIRE_EXTRAS=1``: there a missing module is a broken install, and the test
fails on the ImportError instead of turning into a skip. Outside it (a bare
``pytest`` in an environment without the extras) the test skips with the reason.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRED = os.environ.get("BOOST_REQUIRE_EXTRAS") == "1"


def need(module: str) -> ModuleType:
    """``module`` imported; a skip, or with ``BOOST_REQUIRE_EXTRAS=1`` a failure, if missing."""
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module)
