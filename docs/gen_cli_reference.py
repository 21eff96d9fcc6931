"""Writes docs/cli.md, the reference of every `pagedserve serve` flag, from the parser itself.

Run it after adding or changing a flag: `.venv/bin/python docs/gen_cli_reference.py`.
tests/docs/test_cli_reference.py fails while the committed page differs from what it writes.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from server.cli import build_parser

PAGE = Path(__file__).with_name("cli.md")
# add_flags ends every help with where else the setting comes from and its default.
SOURCES = re.compile(r"\s*\[env (?P<env>[A-Z0-9_]+)(?:; default: (?P<default>.*))?\]$", re.S)

HEADER = """\
# CLI reference

Every flag of `pagedserve serve`, generated from its argument parser by
`docs/gen_cli_reference.py` (run it again after changing a flag; a test fails until then).
Each setting also comes from its environment variable and from the `--config` YAML file, keyed
by flag name. Precedence: flag, then environment, then file, then default (see
[Server settings](server.md)). `pagedserve generate` takes the engine's flags among these,
and `pagedserve bench --help` lists the benchmark's.

| flag | what it sets | environment variable | default |
|---|---|---|---|
"""


def _cell(text: str) -> str:
    """`text` inside one table cell: one line, and a literal `|` that does not end the cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = action.option_strings or [action.dest.upper()]
    shown = " / ".join(f"`{name}`" for name in names)
    if action.choices is not None:
        shown += " `{" + ",".join(str(c) for c in action.choices) + "}`"
    elif action.nargs != 0 and action.option_strings:
        shown += f" `{action.metavar or action.dest.upper()}`"
    return shown


def render() -> str:
    """The page for the parser as it is now."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    rows = []
    for action in commands.choices["serve"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        help_text = action.help or ""
        env = default = ""
        if found := SOURCES.search(help_text):
            help_text = help_text[: found.start()]
            env = f"`{found['env']}`"
            default = f"`{found['default']}`" if found["default"] is not None else ""
        cells = (_flag(action), _cell(help_text), env, _cell(default))
        rows.append("| " + " | ".join(cells) + " |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
