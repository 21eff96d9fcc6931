"""The disk tier: one file per block under a folder, kept across restarts.

A file is written under a temporary name and renamed into place (`os.replace`), so a crash
mid-write leaves a stray temporary file (removed at the next start), never a half-written
block under a block's name. Its header says what it holds (magic, format version, key, model
identity, dtype, shape, payload checksum); a file that is corrupt, truncated or not what its
name says is a miss with one warning, and is removed. Without fsync a power loss can still
leave a renamed file empty or torn: the checksum turns that into a miss too.

The index (key -> size, oldest first) is rebuilt at start-up from the folder's file names and
modification times; a hit touches its file, so the least recently used order survives a
restart. A folder that cannot be written, or a write that fails (a full or read-only disk),
turns the tier off with a warning: serving goes on without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"PGSVKVB\n"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
TEMP_PREFIX = ".tmp-"
_HEADER = struct.Struct("<HI")  # format version, metadata length


class BlockFileError(ValueError):
    """A block file that is not the block its name says."""


def encode_block(key: bytes, identity: bytes, block: torch.Tensor) -> bytes:
    payload = block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    meta = json.dumps(
        {
            "key": key.hex(),
            "model": identity.hex(),
            "dtype": str(block.dtype).removeprefix("torch."),
            "shape": list(block.shape),
            "payload_bytes": len(payload),
            "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }
    ).encode()
    return MAGIC + _HEADER.pack(FORMAT_VERSION, len(meta)) + meta + payload


def decode_block(
    data: bytes, key: bytes, identity: bytes, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The block in `data`, or BlockFileError saying why it is not the one expected."""
    if not data.startswith(MAGIC):
        raise BlockFileError("not a KV block file (no magic)")
    start = len(MAGIC) + _HEADER.size
    if len(data) < start:
        raise BlockFileError("truncated header")
    version, meta_len = _HEADER.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise BlockFileError(f"format version {version}, this engine reads {FORMAT_VERSION}")
    try:
        meta = json.loads(data[start : start + meta_len])
    except ValueError:
        raise BlockFileError("unreadable header") from None
    want = {
        "key": key.hex(),
        "model": identity.hex(),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": list(shape),
    }
    for field, value in want.items():
        if meta.get(field) != value:
            raise BlockFileError(f"its {field} is {meta.get(field)!r}, expected {value!r}")
    payload = data[start + meta_len :]
    if len(payload) != meta.get("payload_bytes"):
        raise BlockFileError(f"truncated: {len(payload)} of {meta.get('payload_bytes')} bytes")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != meta.get("checksum"):
        raise BlockFileError("checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


class DiskTier:
    name = "disk"

    def __init__(
        self,
        folder: Path,
        capacity_bytes: int,
        identity: bytes,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> None:
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.dtype = dtype
        self.shape = shape
        self.used_bytes = 0
        self.enabled = True
        self._index: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._lock = threading.Lock()  # reads on the engine thread, writes on the writer's
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._probe_writable()
            self._scan()
        except OSError as exc:
            self.disable(f"cannot use {folder}: {exc}")

    def disable(self, why: str) -> None:
        log.warning("KV disk tier off: %s; serving goes on without it", why)
        self.enabled = False

    def _probe_writable(self) -> None:
        probe = self.folder / f"{TEMP_PREFIX}probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()

    def _scan(self) -> None:
        """Rebuild the index from the folder: blocks oldest first; leftover temporary files of
        a crashed write go."""
        found: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.folder):
            if entry.name.startswith(TEMP_PREFIX):
                Path(entry.path).unlink(missing_ok=True)
                continue
            key = _key_of(entry.name)
            if key is None or not entry.is_file():
                continue  # not ours: left alone
            stat = entry.stat()
            found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._evict_to(self.capacity_bytes)  # the budget may be smaller than last time
        if self._index:
            log.info(
                "KV disk tier: %d blocks (%.3f GiB) found in %s",
                len(self._index),
                self.used_bytes / 2**30,
                self.folder,
            )

    def path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return self.enabled and key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block under `key`; None when there is none or its file is bad (then removed)."""
        with self._lock:
            if not self.enabled or key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path(key)
        try:
            block = decode_block(path.read_bytes(), key, self.identity, self.dtype, self.shape)
        except (OSError, BlockFileError) as exc:
            log.warning("KV disk tier: %s is unusable (%s): a miss, the file is removed", path, exc)
            self._forget(key)
            return None
        try:
            os.utime(path)  # least recently used order, across restarts too
        except OSError:
            pass
        return block

    def write(self, key: bytes, block: torch.Tensor) -> None:
        """Store a block (the writer thread); a failing disk turns the tier off."""
        data = encode_block(key, self.identity, block)
        with self._lock:
            if not self.enabled or key in self._index or len(data) > self.capacity_bytes:
                return
            self._evict_to(self.capacity_bytes - len(data))
        temp = self.folder / f"{TEMP_PREFIX}{key.hex()}-{uuid.uuid4().hex}"
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.replace(temp, self.path(key))
        except OSError as exc:
            temp.unlink(missing_ok=True)
            with self._lock:
                self.disable(f"writing {self.path(key)} failed: {exc}")
            return
        with self._lock:
            self._index[key] = len(data)
            self.used_bytes += len(data)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
        self.path(key).unlink(missing_ok=True)

    def _evict_to(self, limit: int) -> None:
        """Remove the oldest files until at most `limit` bytes are used (lock held)."""
        while self._index and self.used_bytes > limit:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            try:
                self.path(key).unlink(missing_ok=True)
            except OSError:
                pass


def _key_of(name: str) -> bytes | None:
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name.removesuffix(SUFFIX))
    except ValueError:
        return None
