"""``boost --version`` and the package's version have one source (issue 42, item 6a):
``boost_compiler.__version__``, which pyproject.toml reads as its dynamic version."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import boost_compiler
from boost_compiler.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_boost_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"boost {boost_compiler.__version__}"


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]  # a second copy would drift
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "boost_compiler.__version__"
    setuptools_expand = pytest.importorskip("setuptools.config.expand")
    assert setuptools_expand.read_attr(attr, root_dir=ROOT) == boost_compiler.__version__
