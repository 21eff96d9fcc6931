"""The tiers an engine starts with, from --kv-offloading-*: what they cannot serve is refused,
and their sizes are checked against the memory and disk free now, before anything loads."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from config import ConfigError, EngineConfig
from engine.distributed.shard import WHOLE, Shard
from engine.kv_offload.block_io import KVCaches, PoolBlockIO
from engine.kv_offload.connector import KVOffloadConnector
from engine.kv_offload.disk_tier import SUFFIX, DiskTier
from engine.kv_offload.host_tier import HostTier
from engine.kv_offload.keys import ModelIdentity, weight_files
from engine.kv_offload.tensor_parallel import TensorParallelTiers, WorkerChannel
from engine.loading.model_spec import ModelSpec

GIB = 2**30


def refusal(config: EngineConfig, spec: ModelSpec, draft_kv_bytes: int) -> str | None:
    """Why the tiers cannot serve this engine; None when they can."""
    if not config.cache.enable_prefix_caching:
        return "the tiers find blocks by their prefix-cache hashes: turn prefix caching on"
    if spec.pooler is not None:
        return "a pooling model keeps no KV blocks between requests"
    if draft_kv_bytes:
        return "a draft model's K/V shares the pool's blocks and is not offloaded"
    return None


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _free_disk_bytes(folder: Path) -> int:
    """Free bytes where `folder` is (or would be created), plus what its block files hold:
    they are the tier's own to reuse."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if folder.is_dir():
        free += sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith(SUFFIX))
    return free


def check_sizes(config: EngineConfig) -> None:
    offload = config.kv_offload
    if offload.kv_offloading_size is not None:
        available = available_memory_bytes()
        if available is not None and offload.host_bytes > available:
            raise ConfigError(
                f"--kv-offloading-size {offload.kv_offloading_size:g} GiB: only "
                f"{available / GIB:.2f} GiB of host memory is available"
            )
    folder = offload.kv_offloading_disk_dir
    if folder is not None:
        try:
            free = _free_disk_bytes(folder)
        except OSError:
            return  # an unusable folder turns the tier off with a warning at start
        if offload.disk_bytes > free:
            raise ConfigError(
                f"--kv-offloading-disk-size {offload.kv_offloading_disk_size:g} GiB: only "
                f"{free / GIB:.2f} GiB is free for {folder}"
            )


def check_kv_offload(config: EngineConfig, spec: ModelSpec, draft_kv_bytes: int) -> None:
    """ConfigError for tiers this engine cannot have; run before anything heavy starts."""
    if not config.kv_offload.enabled:
        return
    why = refusal(config, spec, draft_kv_bytes)
    if why is not None:
        raise ConfigError(f"--kv-offloading-size / --kv-offloading-disk-dir: {why}")
    check_sizes(config)


def identity_of(spec: ModelSpec, shard: Shard = WHOLE) -> ModelIdentity:
    weights = spec.gguf_file or spec.path
    return ModelIdentity(
        model=str(weights),
        architecture=spec.architecture,
        num_layers=spec.info.num_layers,
        num_kv_heads=spec.kv_heads_per_rank,
        head_dim=spec.info.head_dim,
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        quantization=spec.quantization,
        weights=weight_files(weights),
        shard=(shard.rank, shard.size) if shard.size > 1 else None,
    )


def make_kv_offload(
    config: EngineConfig,
    spec: ModelSpec,
    kv_caches: Callable[[], KVCaches],
    shard: Shard = WHOLE,
    workers: WorkerChannel | None = None,
) -> KVOffloadConnector | None:
    """A rank's tiers over its runner's paged cache (None without --kv-offloading-*), once
    `check_kv_offload` has passed. Under tensor parallelism each rank has its share of the
    sizes and a folder of its own in the disk directory; rank 0 passes the `workers`."""
    offload = config.kv_offload
    if not offload.enabled:
        return None
    io = PoolBlockIO(kv_caches)
    identity = identity_of(spec, shard).digest()
    host = None
    if offload.kv_offloading_size is not None:
        host = HostTier(offload.host_bytes // shard.size)
    disk = None
    folder = offload.kv_offloading_disk_dir
    if folder is not None:
        if shard.size > 1:
            folder = folder / f"tp{shard.size}-rank{shard.rank}"
        disk = DiskTier(
            folder, offload.disk_bytes // shard.size, identity, spec.dtype, io.block_shape()
        )
    if workers is not None:
        return TensorParallelTiers(identity, io, host, disk, workers)
    return KVOffloadConnector(identity, io, host, disk)
