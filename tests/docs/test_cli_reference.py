"""docs/cli.md lists every flag of `pagedserve serve` as the parser has it now."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

from server.cli import build_parser

ROOT = Path(__file__).parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_cli_reference", ROOT / "docs" / "gen_cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_what_the_parser_gives() -> None:
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == generator().render(), (
        "docs/cli.md is out of date with server/cli.py's flags: "
        "run `.venv/bin/python docs/gen_cli_reference.py` and commit docs/cli.md"
    )


def test_every_flag_and_its_environment_variable_is_on_the_page() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = [a for a in commands.choices["serve"]._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 50
    rows = {line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `-")}
    for action in flags:
        assert any(f"`{action.option_strings[0]}`" in row for row in rows), action.option_strings
        if action.dest != "config":
            assert f"`PAGEDSERVE_{action.dest.upper()}`" in page, action.dest
    assert "| `--max-num-seqs` `MAX_NUM_SEQS` |" in page
    assert "`{fcfs,priority}`" in page  # choices are shown with the flag
