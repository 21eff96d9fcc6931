"""Every python example of the docs and the README is valid Python. The examples that need a
server or a model run in the tests of their feature (tests/support/readme.py reads them); this
catches a broken one on any page, run or not."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.readme import code_blocks

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_python_example_parses() -> None:
    examples = 0
    for page in PAGES:
        for number, source in enumerate(code_blocks(page.read_text(), "python"), 1):
            try:
                ast.parse(source)
            except SyntaxError as exc:
                raise AssertionError(f"{page.name}, python example {number}: {exc}") from exc
            examples += 1
    assert examples >= 10
