"""DOT text to SVG: finds Graphviz's ``dot`` (the system's, else the ``draw`` extra's
``graphviz-pure``) and runs it; without one the ``.dot`` file is still written."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

from .._logging import get_logger

log = get_logger(__name__)
_warned_no_dot = False  # the missing-graphviz warning, once per process


def dot_program() -> str | None:
    """The Graphviz ``dot`` to run: the system's, else the one the ``draw`` extra installs.

    ``pip install boost-compiler[draw]`` brings ``graphviz-pure`` (Graphviz's layout
    engine as one static executable in a wheel), so a user with no system package
    still gets the drawings. It is looked for beside this interpreter too, since a
    virtual environment's scripts folder is often not on ``PATH``.
    """
    found = shutil.which("dot") or shutil.which("graphviz-pure")
    if found is None:
        beside = Path(sysconfig.get_path("scripts")) / "graphviz-pure"
        found = str(beside) if beside.is_file() else None
    return found


def dot_available() -> bool:
    return dot_program() is not None


def render(dot_text: str, path: Path, timeout: float = 120.0) -> Path | None:
    """Write ``path`` (``.dot``) and, when ``dot`` is installed, the ``.svg`` beside it.

    Returns the SVG's path, or None without graphviz (logged once per process) or
    when ``dot`` fails (logged).
    """
    global _warned_no_dot
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dot_text)
    program = dot_program() if dot_available() else None
    if program is None:
        if not _warned_no_dot:
            log.warning(
                "graphviz's `dot` is not on PATH: writing .dot files only; for the drawings "
                "pip install 'boost-compiler[draw]' (or apt-get install graphviz)"
            )
            _warned_no_dot = True
        return None
    svg = path.with_suffix(".svg")
    try:
        subprocess.run(
            [program, "-Tsvg", "-o", str(svg), str(path)],
            check=True, capture_output=True, timeout=timeout,
        )  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        stderr = getattr(err, "stderr", b"") or b""
        log.warning("dot failed on %s: %s %s", path, err, stderr.decode(errors="replace")[-500:])
        return None
    return svg
