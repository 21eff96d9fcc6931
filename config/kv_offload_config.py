"""KV offload tiers: full KV blocks kept outside the paged pool, in host memory and on a local
disk, and found again by prefix after the pool has evicted them.

`--kv-offloading-size` and `--kv-offloading-backend` are vLLM's flags (its host tier); the disk
tier's two flags are ours. Sizes are GiB, checked at start-up against free memory and disk.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 2**30

# vLLM's other backends, named so that the error says they are not served rather than "invalid".
_NOT_SERVED_BACKENDS = ("lmcache",)


class KVOffloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    kv_offloading_size: float | None = Field(
        None,
        gt=0,
        le=65536,
        description="host-memory KV tier in GiB: full KV blocks evicted from the pool are kept "
        "there (least recently used out first) and loaded back when a prompt's prefix finds "
        "them (needs prefix caching; default: off)",
    )
    kv_offloading_backend: str = Field(
        "native", description="KV offloading implementation: only 'native' (this engine's own)"
    )
    kv_offloading_disk_dir: Path | None = Field(
        None,
        description="folder of the disk KV tier: one file per block, kept across restarts "
        "(with --kv-offloading-disk-size; default: no disk tier)",
    )
    kv_offloading_disk_size: float | None = Field(
        None,
        gt=0,
        le=1_048_576,
        description="disk KV tier budget in GiB (oldest files evicted past it)",
    )

    @model_validator(mode="after")
    def _check(self) -> KVOffloadConfig:
        backend = self.kv_offloading_backend
        if backend != "native":
            served = " (vLLM's, not served here)" if backend in _NOT_SERVED_BACKENDS else ""
            raise ValueError(
                f"--kv-offloading-backend: only 'native' is served, got {backend!r}{served}"
            )
        if (self.kv_offloading_disk_dir is None) != (self.kv_offloading_disk_size is None):
            raise ValueError(
                "--kv-offloading-disk-dir and --kv-offloading-disk-size go together: "
                "the disk tier needs both a folder and a budget"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_offloading_disk_dir is not None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers configured, by the names their metrics carry."""
        return tuple(
            name
            for name, on in (
                ("host", self.kv_offloading_size is not None),
                ("disk", self.kv_offloading_disk_dir is not None),
            )
            if on
        )

    @property
    def host_bytes(self) -> int:
        return int((self.kv_offloading_size or 0) * GIB)

    @property
    def disk_bytes(self) -> int:
        return int((self.kv_offloading_disk_size or 0) * GIB)
