"""Reading an adapter's files, which are user input: only regular files, never past a cap.

A path may name a named pipe (an open for reading waits for a writer, forever), a device (it
never ends) or a file far larger than any adapter; a plain `read_text` or an mmap would hang or
exhaust the process on them. So the type is checked before the open (a device is never opened
at all), the open does not block, the open file is checked again (the path may have been
swapped in between), and the read stops one byte past the cap whatever the size said.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

CHUNK_BYTES = 1 << 20
# Not blocking on a pipe without a writer, and never taking a terminal as the process's own.
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class FileRefused(ValueError):
    """A file that is not read: not a regular file, or larger than its cap."""


class FileTooLarge(FileRefused):
    pass


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    )
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def _check(path: Path, info: os.stat_result, limit: int) -> None:
    kind = _kind(info.st_mode)
    if kind is not None:
        raise FileRefused(f"{path.name} is {kind}, not a regular file")
    if info.st_size > limit:
        raise FileTooLarge(f"{path.name} holds {info.st_size} bytes, more than the {limit} allowed")


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at `path` (symbolic links followed), at most `limit` of
    them; FileRefused otherwise, FileNotFoundError if there is none."""
    _check(path, os.stat(path), limit)
    fd = os.open(path, OPEN_FLAGS)
    try:
        _check(path, os.fstat(fd), limit)
        chunks, size = [], 0
        while size <= limit:  # a file that grows while read is cut one byte past the cap
            chunk = os.read(fd, min(CHUNK_BYTES, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise FileTooLarge(f"{path.name} grew past the {limit} bytes allowed while it was read")
    return b"".join(chunks)
