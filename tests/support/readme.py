"""The README's examples as written, for the tests that run them against a real server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def section_examples(heading: str) -> tuple[str, str]:
    """The one bash and the one python example of the README section `### heading`."""
    text = README.read_text()
    section = text[text.index(f"### {heading}\n") :]
    section = section[: section.index("\n### ", 1)]
    (curl,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return curl, snippet


def python_examples(heading: str) -> list[str]:
    """The python examples of the README section `### heading`, in order."""
    text = README.read_text()
    section = text[text.index(f"### {heading}\n") :]
    section = section[: section.index("\n### ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run_example(url: str, language: str, source: str) -> str:
    """What `source` prints when run against the server at `url` instead of localhost:8000."""
    source = source.replace("http://localhost:8000", url)
    argv = ["bash", "-c", source] if language == "bash" else [sys.executable, "-c", source]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
