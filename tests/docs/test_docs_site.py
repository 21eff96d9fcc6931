"""The documentation site builds under `mkdocs build --strict`: a broken link, a broken anchor or
a page missing from the nav fails it, and so fails `make test`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    argv += ["--config-file", str(project / "mkdocs.yml"), "--site-dir", str(site)]
    # The theme's notice about its successor goes to stderr on every build; it is no warning.
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def copy_of_the_docs(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    return project


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    pages = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    listed = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages >= listed
    architecture = (tmp_path / "site" / "architecture" / "index.html").read_text()
    assert '<pre class="mermaid">' in architecture  # the diagrams are drawn, not shown as code


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    project = copy_of_the_docs(tmp_path)
    page = project / "docs" / "lora.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    done = build(project, tmp_path / "site")
    assert done.returncode != 0 and "missing.md" in done.stderr


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    project = copy_of_the_docs(tmp_path)
    page = project / "docs" / "lora.md"
    page.write_text(page.read_text() + "\nSee [metrics](metrics.md#no-such-heading).\n")
    done = build(project, tmp_path / "site")
    assert done.returncode != 0 and "no-such-heading" in done.stderr


def test_a_page_missing_from_the_nav_fails_the_build(tmp_path: Path) -> None:
    project = copy_of_the_docs(tmp_path)
    (project / "docs" / "orphan.md").write_text("# Orphan\n")
    done = build(project, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr
