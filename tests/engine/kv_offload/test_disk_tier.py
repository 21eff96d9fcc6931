"""The disk tier's files and index without an engine: a block round-trips bit for bit in its
dtype; the index is rebuilt from the folder at start-up, oldest first by modification time,
with a crashed write's temporary file removed and files not named as blocks left alone; a
read makes a block the newest; writes evict the oldest files past the budget."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.kv_offload.disk_tier import SUFFIX, TEMP_PREFIX, DiskTier

SHAPE = (2, 2, 4, 1, 8)
IDENTITY = b"i" * 16


def tier(folder: Path, blocks: int = 8) -> DiskTier:
    size = 2 * torch.zeros(SHAPE, dtype=torch.bfloat16).nbytes  # the payload and then some
    return DiskTier(folder, blocks * size, IDENTITY, torch.bfloat16, SHAPE)


def key(i: int) -> bytes:
    return bytes([i]) * 16


def block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).bfloat16()


def test_a_block_round_trips_and_the_index_survives_a_restart(tmp_path: Path) -> None:
    disk = tier(tmp_path)
    for i in range(3):
        disk.write(key(i), block(i))
        os.utime(disk.path(key(i)), (1000 + i, 1000 + i))  # written in this order
    (tmp_path / f"{TEMP_PREFIX}{key(9).hex()}-crashed").write_bytes(b"half a block")
    (tmp_path / "notes.txt").write_text("mine")
    again = tier(tmp_path)
    assert len(again) == 3 and again.used_bytes == disk.used_bytes
    got = again.read(key(1))
    assert got is not None and torch.equal(got, block(1))  # also the newest now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(key(i).hex() + SUFFIX for i in range(3)), "notes.txt"]
    )
    assert again.read(key(7)) is None
    # A budget of two blocks at the next start: the oldest goes, the one just read stays.
    smaller = DiskTier(tmp_path, disk.used_bytes * 2 // 3, IDENTITY, torch.bfloat16, SHAPE)
    assert len(smaller) == 2
    assert key(1) in smaller and key(2) in smaller and key(0) not in smaller
    assert not disk.path(key(0)).exists()


def test_writes_evict_the_oldest_files_past_the_budget(tmp_path: Path) -> None:
    disk = tier(tmp_path, blocks=3)
    file_size = 0
    for i in range(5):
        disk.write(key(i), block(i))
        file_size = disk.path(key(i)).stat().st_size
    assert disk.used_bytes == 3 * file_size <= disk.capacity_bytes
    assert [k in disk for k in map(key, range(5))] == [False, False, True, True, True]
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 3
