"""The examples of the README and the docs pages as written, for the tests that run them against a
real server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def section(heading: str, page: str = "README.md") -> str:
    """The text under the heading `heading` (any level) of `page` (README.md, or a docs page such
    as "responses.md"), up to the next heading of the same or a higher level; headings inside
    code blocks (bash comments) do not count."""
    path = README if page == "README.md" else DOCS / page
    lines = path.read_text().splitlines(keepends=True)
    start = level = None
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        found = None if fenced else re.match(r"(#+) (.*)\n", line)
        if found is None:
            continue
        if start is None and found[2] == heading:
            start, level = i, len(found[1])
        elif start is not None and level is not None and len(found[1]) <= level:
            return "".join(lines[start:i])
    assert start is not None, f"no heading {heading!r} in {path}"
    return "".join(lines[start:])


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced `language` blocks of `text`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def section_examples(heading: str, page: str = "README.md") -> tuple[str, str]:
    """The one bash and the one python example of the section `heading` of `page`."""
    text = section(heading, page)
    (curl,) = code_blocks(text, "bash")
    (snippet,) = code_blocks(text, "python")
    return curl, snippet


def python_examples(heading: str, page: str = "README.md") -> list[str]:
    """The python examples of the section `heading` of `page`, in order."""
    return code_blocks(section(heading, page), "python")


def run_example(url: str, language: str, source: str) -> str:
    """What `source` prints when run against the server at `url` instead of localhost:8000."""
    source = source.replace("http://localhost:8000", url)
    argv = ["bash", "-c", source] if language == "bash" else [sys.executable, "-c", source]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
