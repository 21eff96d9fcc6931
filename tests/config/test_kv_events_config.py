"""Where `--kv-events-config` publishes: with no endpoint named, on the server's --host (a
server kept on loopback keeps its cache contents there too) and bound; a named endpoint
exactly as vLLM treats it; the Python API, which has no --host, on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config import ConfigError, EngineConfig, KVEventsConfig, ServeConfig, ServerConfig
from config.sources import serve_config

ON = '{"enable_kv_cache_events": true}'


def events_of(config: ServeConfig) -> KVEventsConfig:
    events = config.engine.cache.kv_events_config
    assert events is not None and events.enabled
    return events


@pytest.mark.parametrize(
    ("host", "endpoint"),
    [
        ("127.0.0.1", "tcp://127.0.0.1:5557"),
        ("localhost", "tcp://localhost:5557"),
        ("10.0.0.7", "tcp://10.0.0.7:5557"),
        ("0.0.0.0", "tcp://0.0.0.0:5557"),  # --host names every interface: so do the events
        ("::1", "tcp://[::1]:5557"),
        ("::", "tcp://[::]:5557"),
        ("[fd00::2]", "tcp://[fd00::2]:5557"),
    ],
)
def test_the_default_endpoint_is_bound_on_the_servers_host(host: str, endpoint: str) -> None:
    events = events_of(serve_config({"host": host, "kv_events_config": ON}, {}))
    assert (events.address, events.binds) == (endpoint, True)


def test_the_host_from_the_environment_or_a_file_places_the_events_too(tmp_path: Path) -> None:
    env = {"PAGEDSERVE_HOST": "127.0.0.1", "PAGEDSERVE_KV_EVENTS_CONFIG": ON}
    assert events_of(serve_config({}, env)).address == "tcp://127.0.0.1:5557"
    path = tmp_path / "serve.yaml"
    path.write_text(f"host: 10.1.2.3\nkv-events-config: '{ON}'\n")
    assert events_of(serve_config({}, {}, path)).address == "tcp://10.1.2.3:5557"
    # With no --host at all, the server listens on every interface, and so do the events.
    assert events_of(serve_config({"kv_events_config": ON}, {})).address == "tcp://0.0.0.0:5557"


@pytest.mark.parametrize(
    ("settings", "endpoint", "binds"),
    [
        # vLLM's rule: a wildcard, ipc:// or inproc:// is bound, anything else connected to.
        ({"endpoint": "tcp://*:5557"}, "tcp://*:5557", True),
        ({"endpoint": "tcp://[::]:6000"}, "tcp://[::]:6000", True),
        ({"endpoint": "ipc:///tmp/kv.sock"}, "ipc:///tmp/kv.sock", True),
        ({"endpoint": "inproc://kv"}, "inproc://kv", True),
        ({"endpoint": "tcp://10.0.0.9:5557"}, "tcp://10.0.0.9:5557", False),
        ({"endpoint": "tcp://127.0.0.1:5557"}, "tcp://127.0.0.1:5557", False),
        # `bind` overrides the rule either way: one chosen interface, or a wildcard's opposite.
        ({"endpoint": "tcp://10.0.0.9:5557", "bind": True}, "tcp://10.0.0.9:5557", True),
        ({"endpoint": "ipc:///tmp/kv.sock", "bind": False}, "ipc:///tmp/kv.sock", False),
    ],
)
def test_a_named_endpoint_is_kept_whatever_the_host(
    settings: dict[str, object], endpoint: str, binds: bool
) -> None:
    value = json.dumps({"enable_kv_cache_events": True, **settings})
    for host in ("127.0.0.1", "0.0.0.0"):
        events = events_of(serve_config({"host": host, "kv_events_config": value}, {}))
        assert (events.endpoint, events.address, events.binds) == (endpoint, endpoint, binds)
    # Offline, the same: nothing about a named endpoint depends on the server.
    events = EngineConfig.from_kwargs(kv_events_config=value).cache.kv_events_config
    assert events is not None and (events.address, events.binds) == (endpoint, binds)


def test_the_python_api_binds_loopback_by_default() -> None:
    events = EngineConfig.from_kwargs(kv_events_config=ON).cache.kv_events_config
    assert events is not None and events.endpoint is None
    assert (events.address, events.binds) == ("tcp://127.0.0.1:5557", True)


def test_one_engine_config_served_on_two_hosts_keeps_each_hosts_endpoint() -> None:
    """The resolution copies: the engine config a caller passed in is left as it was."""
    engine = EngineConfig.from_kwargs(kv_events_config=ON)
    first = ServeConfig(engine=engine, server=ServerConfig(host="127.0.0.1"))
    second = ServeConfig(engine=engine, server=ServerConfig(host="10.0.0.7"))
    assert events_of(first).address == "tcp://127.0.0.1:5557"
    assert events_of(second).address == "tcp://10.0.0.7:5557"
    assert engine.cache.kv_events_config is not None
    assert engine.cache.kv_events_config.endpoint is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        # Nothing to connect to: the default endpoint is this server's own address.
        ({"bind": False}, ["--kv-events-config", "'bind': false", "'endpoint'"]),
        ({"bind": "sometimes"}, ["--kv-events-config", "'bind'", "boolean", "sometimes"]),
        (
            {"bnd": True},
            ["--kv-events-config", "unknown key 'bnd'", "endpoint, bind, replay_endpoint"],
        ),
    ],
)
def test_bad_bind_settings_name_the_flag_and_key(
    value: dict[str, object], words: list[str]
) -> None:
    text = json.dumps({"enable_kv_cache_events": True, **value})
    with pytest.raises(ConfigError) as err:
        serve_config({"host": "127.0.0.1", "kv_events_config": text}, {})
    for word in words:
        assert word in str(err.value), (word, str(err.value))
