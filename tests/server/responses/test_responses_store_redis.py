"""The Redis response store, on real redis-servers, in what the shared contract tests
(tests/server/responses/test_responses_store.py) cannot see: Redis itself expiring responses, replicas sharing one
server, a server that is down, hung, restarted or wants a password, and the specs that choose it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from redis import Redis

from server.openai.responses.store import ResponseStoreError, open_response_store
from server.openai.responses.store.redis import INDEX_KEY, ITEM_PREFIX, RedisResponseStore, redacted
from tests.support.redis_server import running_redis
from tests.support.responses_backends import BIG, DAY, RedisBackend, json_size, make
from tests.support.server_harness import ROOT, free_port

# A bound against hangs, not a speed test: the store's own timeouts are a few seconds.
FAST_S = 10.0


def fails_fast(call: Callable[[], object], says: str) -> ResponseStoreError:
    """The ResponseStoreError that `call` raises, which must say `says` (plain text)."""
    started = time.monotonic()
    with pytest.raises(ResponseStoreError, match=re.escape(says)) as info:
        call()
    assert time.monotonic() - started < FAST_S
    return info.value


def test_redis_itself_drops_expired_responses(redis_url: str) -> None:
    backend = RedisBackend(redis_url)
    store = RedisResponseStore(redis_url, 0.5, BIG)
    store.put(make("resp_1"))
    assert 0 < backend.client.pttl(ITEM_PREFIX + "resp_1") <= 500
    assert store.get("resp_1") is not None
    time.sleep(0.6)
    # Gone from Redis, not only hidden by get.
    assert backend.client.exists(ITEM_PREFIX + "resp_1") == 0
    assert store.get("resp_1") is None
    # Its index entry and bytes outlive it until the next put walks past them.
    assert backend.client.zrange(INDEX_KEY, 0, -1) == ["resp_1"]
    fresh = make("resp_2")
    store.put(fresh)
    assert backend.held() == {"resp_2": json_size(fresh)}
    assert backend.total_bytes() == json_size(fresh)
    assert store.delete("resp_1") is False
    store.close()
    backend.close()


def test_get_checks_the_age_by_this_server_clock_too(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose clock runs ahead of Redis's must not return what it counts as expired,
    though Redis still holds it."""
    backend = RedisBackend(redis_url)
    store = RedisResponseStore(redis_url, 60.0, BIG)
    store.put(make("resp_1"))
    ahead = time.time() + 120
    monkeypatch.setattr(
        "server.openai.responses.store.redis.time", SimpleNamespace(time=lambda: ahead)
    )
    assert store.get("resp_1") is None
    assert backend.client.exists(ITEM_PREFIX + "resp_1") == 1
    assert store.delete("resp_1") is False  # agrees with get, and deletes it all the same
    assert backend.held() == {}
    store.close()
    backend.close()


def test_replicas_share_responses_and_one_size_bound(redis_url: str) -> None:
    backend = RedisBackend(redis_url)
    size = json_size(make("resp_0"))  # all ids have the same length
    first = RedisResponseStore(redis_url, DAY, 3 * size)
    second = RedisResponseStore(redis_url, DAY, 3 * size)
    stored = make("resp_0", created_at=time.time() - 10)
    first.put(stored)
    assert second.get("resp_0") == stored
    # "yo": as long as every other text here, so that all responses have one size.
    second.put(make("resp_1", created_at=time.time() - 9, text="yo"))
    got = first.get("resp_1")
    assert got is not None and got.response["output_text"] == "yo"
    assert second.delete("resp_0") is True
    assert first.get("resp_0") is None
    assert first.delete("resp_0") is False
    # The bound counts what both put: the fourth response evicts the oldest, whoever put it.
    first.put(make("resp_2", created_at=time.time() - 8))
    second.put(make("resp_3", created_at=time.time() - 7))
    assert set(backend.held()) == {"resp_1", "resp_2", "resp_3"}
    first.put(make("resp_4"))
    assert set(backend.held()) == {"resp_2", "resp_3", "resp_4"}
    assert second.get("resp_1") is None
    first.close()
    second.close()
    backend.close()


def test_replicas_evicting_at_once_keep_the_total_exact(redis_url: str) -> None:
    """Eight threads over two stores, each put evicting: the item, index, sizes and total stay
    in step, which a put that is not one atomic step would break."""
    backend = RedisBackend(redis_url)
    size = json_size(make("resp_0_00"))  # all ids below have this length
    stores = [RedisResponseStore(redis_url, DAY, 10 * size) for _ in range(2)]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            start.wait()
            for i in range(30):
                stores[t % 2].put(make(f"resp_{t}_{i:02}"))
        except BaseException as e:  # noqa: BLE001 - any failure in a thread fails the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    held = backend.held()  # also checks that the index and sizes name exactly the items
    assert len(held) == 10
    assert backend.total_bytes() == sum(held.values()) == 10 * size
    for store in stores:
        store.close()
    backend.close()


def test_a_stopped_server_fails_each_call_fast_and_a_restarted_one_serves(tmp_path: Path) -> None:
    port = free_port()
    with running_redis(tmp_path / "first", port) as url:
        store = RedisResponseStore(url, DAY, BIG)
        store.put(make("resp_1"))
    where = f"responses store {url}"
    fails_fast(lambda: store.put(make("resp_2")), f"cannot write to the {where}")
    fails_fast(lambda: store.get("resp_1"), f"cannot read the {where}")
    fails_fast(lambda: store.delete("resp_1"), f"cannot write to the {where}")
    # A new, empty server on the same port, without the scripts the first one had loaded.
    with running_redis(tmp_path / "second", port):
        assert store.get("resp_1") is None
        store.put(make("resp_2"))
        assert store.get("resp_2") is not None
        assert store.delete("resp_2") is True
    store.close()


def test_opening_fails_when_nothing_listens_and_hides_passwords() -> None:
    port = free_port()  # bound, then released: nothing listens there
    url = f"redis://app:s3cret%2Fpw@127.0.0.1:{port}/2?password=qu3ry-pw&socket_keepalive=true"
    error = fails_fast(lambda: RedisResponseStore(url, DAY, BIG), "cannot reach")
    message = str(error)
    assert f"redis://app:***@127.0.0.1:{port}/2?password=***&socket_keepalive=true" in message
    assert "s3cret" not in message and "qu3ry" not in message
    assert error.__suppress_context__  # not shown again through a chained exception
    fails_fast(lambda: open_response_store(url, Path("/unused"), DAY, BIG), "cannot reach")


def test_redacted_leaves_urls_without_passwords_alone() -> None:
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted("unix:///run/redis.sock?db=3") == "unix:///run/redis.sock?db=3"
    assert redacted("rediss://user@host:6380/1") == "rediss://user@host:6380/1"
    assert redacted("rediss://:pw@host/1") == "rediss://:***@host/1"
    assert redacted("unix://:pw@/run/redis.sock") == "unix://:***@/run/redis.sock"
    assert redacted("unix:///run/redis.sock?password=pw") == "unix:///run/redis.sock?password=***"


def test_a_wrong_password_is_a_store_error_that_hides_it(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as url:
        with Redis.from_url(url) as admin:
            admin.config_set("requirepass", "right-pw")
        wrong = url.replace("redis://", "redis://:wrong-pw@")
        error = fails_fast(lambda: RedisResponseStore(wrong, DAY, BIG), "AuthenticationError")
        assert "wrong-pw" not in str(error) and "redis://:***@127.0.0.1" in str(error)
        store = RedisResponseStore(url.replace("redis://", "redis://:right-pw@"), DAY, BIG)
        stored = make("resp_1")
        store.put(stored)
        assert store.get("resp_1") == stored
        store.close()


def test_a_server_that_never_answers_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shortened here; the defaults are a few seconds, and this shows they are the ones used.
    monkeypatch.setattr("server.openai.responses.store.redis._READ_TIMEOUT_S", 0.3)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # connections complete in the backlog; nothing ever answers
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ResponseStoreError, match=r"cannot reach .*Timeout"):
            RedisResponseStore(f"redis://127.0.0.1:{port}/0", DAY, BIG)
        assert time.monotonic() - started < 3.0


def test_redis_and_unix_specs_open_a_shared_redis_store(redis_url: str, tmp_path: Path) -> None:
    with Redis.from_url(redis_url, decode_responses=True) as admin:
        socket_path = admin.config_get("unixsocket")["unixsocket"]
    over_tcp = open_response_store(redis_url, tmp_path, DAY, BIG)
    over_socket = open_response_store(f"unix://{socket_path}?db=0", tmp_path, DAY, BIG)
    assert isinstance(over_tcp, RedisResponseStore)
    assert isinstance(over_socket, RedisResponseStore)
    stored = make("resp_1")
    over_tcp.put(stored)
    assert over_socket.get("resp_1") == stored
    # Another database of the same server is another store.
    other_db = open_response_store(redis_url.removesuffix("/0") + "/1", tmp_path, DAY, BIG)
    assert other_db.get("resp_1") is None
    for store in (over_tcp, over_socket, other_db):
        store.close()
    assert list(tmp_path.iterdir()) == []  # nothing in the cache folder


def test_a_rediss_spec_speaks_tls(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The test server speaks plain TCP, so the TLS handshake cannot complete: the spec reached
    # a Redis store that tried TLS, and failed as a store error.
    monkeypatch.setattr("server.openai.responses.store.redis._CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr("server.openai.responses.store.redis._READ_TIMEOUT_S", 0.3)
    tls_url = redis_url.replace("redis://", "rediss://")
    fails_fast(
        lambda: open_response_store(tls_url, Path("/unused"), DAY, BIG),
        f"cannot reach the responses store {tls_url}",
    )


def test_an_unreadable_redis_url_is_refused_as_a_setting() -> None:
    with pytest.raises(ValueError, match="not valid"):
        open_response_store("redis://127.0.0.1:notaport/0", Path("/unused"), DAY, BIG)


def test_the_redis_package_is_imported_only_for_a_redis_store() -> None:
    check = "import sys, server.openai.responses.store; assert 'redis' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
