"""The README is a front door (issue 43): at most 250 lines, and every docs/ page is reachable
from it in at most two clicks, each link pointing at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _links(page: Path) -> set[Path]:
    return {(page.parent / target).resolve() for target in LINK.findall(page.read_text())}


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move sections into docs/"


def test_every_docs_page_is_two_clicks_from_the_readme() -> None:
    readme = (ROOT / "README.md").resolve()
    one = _links(readme)
    two = set().union(*(_links(p) for p in one if p.exists()))
    for page in one | two:
        assert page.exists(), f"a link points at {page.relative_to(ROOT)}, which does not exist"
    reach = one | two | {readme}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in reach]
    assert not missing, f"docs pages not linked within two clicks of README.md: {missing}"
