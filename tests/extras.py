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


def need_dot() -> str:
    """The Graphviz ``dot`` the explain report draws with: the system's, else the one the
    ``draw`` extra installs (graphviz-pure, a wheel: ``boost_compiler.explain.draw``
    looks for both). A skip without either, or with ``BOOST_REQUIRE_EXTRAS=1`` (where the
    extra is installed) a failure: there a missing drawing path is a broken install."""
    from boost_compiler.explain.draw import dot_program

    program = dot_program()
    if program is None:
        why = ("neither graphviz's `dot` nor the draw extra's graphviz-pure is installed "
               "(pip install -e '.[draw]')")  # fmt: skip
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    return program


def drawings_expected() -> bool:
    """Whether a run must have written SVGs: with ``BOOST_REQUIRE_EXTRAS=1`` always (the
    checks then fail where nothing was drawn), else when a ``dot`` is found."""
    from boost_compiler.explain.draw import dot_available

    return REQUIRED or dot_available()


def need_kernels() -> ModuleType:
    """The ``kernels`` package, whose ``use_kernelized_func`` wrapper puts a side effect
    (a ContextVar set) into HF forwards when installed. transformers 5.25 depends on it,
    so with ``BOOST_REQUIRE_EXTRAS=1`` and transformers >= 5.25 (the compat tier,
    ``bash dev.sh compat``) a missing one fails; with 5.24 it is optional and skips."""
    from importlib.metadata import version

    from packaging.version import Version

    tf = Version(version("transformers"))
    if REQUIRED and tf >= Version("5.25"):
        return importlib.import_module("kernels")
    return pytest.importorskip(
        "kernels", reason=f"the kernels package is not installed (optional with transformers {tf})"
    )
