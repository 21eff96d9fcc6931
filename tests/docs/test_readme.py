"""The README stays a front page: short, and every link into the docs resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
LINE_BUDGET = 250


def test_the_readme_stays_within_its_line_budget() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= LINE_BUDGET, f"README.md has {lines} lines; move detail into docs/"


def test_the_readmes_links_into_the_docs_resolve() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert len(links) >= 15  # every feature links to its page
    for link in links:
        assert (ROOT / link).is_file(), link
