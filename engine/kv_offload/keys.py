"""What names a block in the tiers: a stable hash of everything that determines its K/V.

The pool's chained block hash (engine/core/kv_cache_manager.py `chain_hash`) already covers
the tokens, the chain before them, the LoRA adapter (the chain's root) and the images; the
model's identity adds what the pool never needs to say, because one pool serves one model:
which weights, which layer shapes, which KV dtype and block size. Everything is blake2b over
bytes, never Python's `hash()`, so a key is the same in every process."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

KEY_BYTES = 16


@dataclass(frozen=True)
class ModelIdentity:
    model: str  # the resolved model folder or file
    architecture: str
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    kv_dtype: str
    block_size: int
    quantization: str | None  # another format of the same weights computes other K/V
    # Each weight file's name, size and modification time: weights replaced in the same folder
    # (a new revision saved over the old) must not find the old weights' blocks on disk.
    weights: tuple[tuple[str, int, int], ...] = ()
    # Under tensor parallelism, (rank, ranks): which slice of the heads a rank's blocks hold.
    # Left out of the digest with one rank, so that one rank's keys stay what they were.
    shard: tuple[int, int] | None = None

    def digest(self) -> bytes:
        fields = asdict(self)
        if self.shard is None:
            del fields["shard"]
        text = json.dumps(fields, sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()


def tier_key(identity_digest: bytes, block_hash: bytes) -> bytes:
    return hashlib.blake2b(identity_digest + block_hash, digest_size=KEY_BYTES).digest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weight_files(model: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime in ns) of the weights at `model`, a folder or a single file."""
    files = [model] if model.is_file() else sorted(model.iterdir()) if model.is_dir() else []
    return tuple(
        (f.name, (st := f.stat()).st_size, st.st_mtime_ns)
        for f in files
        if f.name.endswith(WEIGHT_SUFFIXES)
    )
