"""A folder written once and then reused: made in a sibling temporary folder and renamed into
place, so that a concurrent or interrupted run never sees it half-written."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_once(target: Path, ready: Callable[[Path], bool], write: Callable[[Path], None]) -> Path:
    """`target`, calling `write(folder)` to make it unless `ready(target)` says it is there."""
    if ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another run renamed its own first: use that one
            if not ready(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
