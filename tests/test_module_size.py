"""No module of the package is over 500 lines (issue 43): a longer one is split by what its
parts do, as explain/draw.py, costmodel and convert.py were."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "boost_compiler"
LIMIT = 500


def test_no_package_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > LIMIT
    }
    assert not long, f"modules over {LIMIT} lines (split them by what they do): {long}"
