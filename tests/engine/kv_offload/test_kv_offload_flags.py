"""The KV offload flags: parsed from the command line and the environment into their section,
and refused at start-up, with a message naming the flag, where the tiers cannot serve."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from config import ConfigError, EngineConfig
from config.sources import SERVE_SECTIONS, add_flags, serve_config
from engine import LLM

SMALL = {"num_kv_blocks": 32, "max_model_len": 128, "block_size": 16}


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser, SERVE_SECTIONS)
    return serve_config(vars(parser.parse_args(argv)), {}).engine


def test_the_flags_reach_their_section(tmp_path: Path) -> None:
    config = parse(
        [
            "--kv-offloading-size", "2.5",
            "--kv-offloading-backend", "native",
            "--kv-offloading-disk-dir", str(tmp_path),
            "--kv-offloading-disk-size", "0.5",
        ]
    )  # fmt: skip
    offload = config.kv_offload
    assert offload.kv_offloading_size == 2.5 and offload.host_bytes == int(2.5 * 2**30)
    assert offload.kv_offloading_disk_dir == tmp_path and offload.disk_bytes == 2**29
    assert offload.enabled
    env = serve_config({}, {"PAGEDSERVE_KV_OFFLOADING_SIZE": "1"}).engine.kv_offload
    assert env.kv_offloading_size == 1.0
    assert not parse([]).kv_offload.enabled


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_offloading_backend": "lmcache"}, "only 'native' is served, got 'lmcache'"),
        ({"kv_offloading_backend": "other"}, "--kv-offloading-backend: only 'native'"),
        ({"kv_offloading_disk_dir": "/tmp/x"}, "go together"),
        ({"kv_offloading_disk_size": 1.0}, "go together"),
        ({"kv_offloading_size": 0}, "--kv-offloading-size: must be > 0"),
    ],
)
def test_bad_values_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"enable_prefix_caching": False}, "turn prefix caching on"),
        ({"async_scheduling": True}, "--async-scheduling: the KV offload tiers"),
        ({"kv_offloading_size": 60000.0}, "GiB of host memory is available"),
    ],
)
def test_what_the_tiers_cannot_serve_is_refused_at_start(
    qwen3_dir: Path, settings: dict[str, object], message: str
) -> None:
    settings = {"kv_offloading_size": 0.01, **settings}
    with pytest.raises(ConfigError, match=message):
        LLM(str(qwen3_dir), **SMALL, **settings)


def test_a_disk_tier_larger_than_the_free_disk_is_refused(qwen3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--kv-offloading-disk-size 1e\+06 GiB: only .* free"):
        LLM(
            str(qwen3_dir),
            **SMALL,
            kv_offloading_disk_dir=str(tmp_path / "tier"),
            kv_offloading_disk_size=1_000_000,
        )
    assert not (tmp_path / "tier").exists()  # refused before anything was made
