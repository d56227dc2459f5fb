"""Every example in a public docstring runs, as a user would run it (issue 26).

The examples of the package docstring and of every name in ``boost_compiler.__all__``
that has one (the text after ``Example...::``) each run in a fresh interpreter whose
working directory is an empty folder: an example that imports a module only a
checkout has (``examples.*``, ``tests.*``) fails here. Examples written for torchrun
run as rank 0 of a one-process group (torchrun's environment variables set by hand):
the same code path, without a second process.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import boost_compiler

_EXAMPLE = re.compile(r"Example[^\n]*::\n\n((?:[ \t]+[^\n]*\n|\n)+)")


def _examples() -> dict[str, str]:
    found = {}
    owners = {"boost_compiler": boost_compiler}
    owners.update({name: getattr(boost_compiler, name) for name in boost_compiler.__all__})
    for name, obj in owners.items():
        doc = obj.__doc__ or ""
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        m = _EXAMPLE.search(doc if doc.endswith("\n") else doc + "\n")
        if m:
            found[name] = textwrap.dedent(m.group(1))
    return found


EXAMPLES = _examples()


def test_the_public_api_has_examples() -> None:
    assert {"boost_compiler", "parallelize", "detect", "to_low_rank", "explain"} <= set(EXAMPLES)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs(name: str, tmp_path: Path) -> None:
    code = EXAMPLES[name]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "torchrun" in (getattr(boost_compiler, name, boost_compiler).__doc__ or ""):
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{name}'s example failed:\n{code}\n{done.stderr[-3000:]}"
