"""The Responses API store: the contract every backend keeps (round trips, replacing, the age
and size bounds, threads), run on SQLite files and on a real Redis server, then what is SQLite's
own (restarts, schema, bad files and locks) and the settings that choose a store."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from config import ServerConfig
from server.openai.responses.store import (
    NoResponseStore,
    ResponseStore,
    ResponseStoreError,
    SQLiteResponseStore,
    open_response_store,
)
from server.openai.responses.store.sqlite import SCHEMA_VERSION
from tests.support.responses_backends import (
    BIG,
    DAY,
    Backend,
    RedisBackend,
    SQLiteBackend,
    json_size,
    make,
)


@pytest.fixture(params=["sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each contract test runs on both backends; the Redis one on the session's redis-server,
    emptied."""
    chosen: Backend
    if request.param == "sqlite":
        chosen = SQLiteBackend(tmp_path / "r.sqlite3")
    else:
        chosen = RedisBackend(request.getfixturevalue("redis_url"))
    yield chosen
    chosen.close()


def rows(path: Path) -> dict[str, int]:
    """What a SQLite file itself holds, read behind the store's back: id -> size."""
    return SQLiteBackend(path).held()


# --------------------------------------------------------------------------- every backend


def test_put_get_delete_round_trip(backend: Backend) -> None:
    store = backend.open(DAY, BIG)
    stored = make("resp_1")
    store.put(stored)
    assert store.get("resp_1") == stored  # every field, non-ASCII text and floats included
    # The size bound counts UTF-8 bytes of the JSON, not characters.
    assert backend.held() == {"resp_1": json_size(stored)}
    assert backend.total_bytes() == json_size(stored)
    assert store.get("resp_2") is None
    assert store.delete("resp_1") is True
    assert store.get("resp_1") is None
    assert store.delete("resp_1") is False
    assert store.delete("never") is False
    assert backend.held() == {}
    assert backend.total_bytes() == 0
    store.close()
    store.close()  # idempotent
    with pytest.raises(ResponseStoreError, match="closed"):
        store.get("resp_1")
    with pytest.raises(ResponseStoreError, match="closed"):
        store.put(make("resp_1"))
    with pytest.raises(ResponseStoreError, match="closed"):
        store.delete("resp_1")


def test_put_replaces_an_existing_id(backend: Backend) -> None:
    store = backend.open(DAY, BIG)
    store.put(make("resp_1", text="first"))
    store.put(make("resp_1", text="second, and longer"))
    got = store.get("resp_1")
    assert got is not None and got.response["output_text"] == "second, and longer"
    assert list(backend.held()) == ["resp_1"]
    # The byte total counts the replacement only, not both versions.
    assert backend.total_bytes() == backend.held()["resp_1"]
    store.close()


def test_expired_rows_are_not_returned_and_are_deleted_on_put(backend: Backend) -> None:
    store = backend.open(60.0, BIG)
    now = time.time()
    store.put(make("old", created_at=now - 120))
    assert store.get("old") is None  # expired, even before any put deletes it
    assert store.delete("old") is False  # agrees with get
    store.put(make("old2", created_at=now - 120))
    store.put(make("fresh", created_at=now))
    assert set(backend.held()) == {"fresh"}  # the put deleted the expired row
    assert store.get("fresh") is not None
    assert backend.total_bytes() == backend.held()["fresh"]
    store.close()


def test_tiny_max_age_expires_within_milliseconds(backend: Backend) -> None:
    store = backend.open(0.02, BIG)
    store.put(make("resp_1"))
    assert store.get("resp_1") is not None
    time.sleep(0.05)
    assert store.get("resp_1") is None
    store.close()


def test_size_bound_evicts_oldest_first_and_keeps_the_newest(backend: Backend) -> None:
    probe = backend.open(DAY, BIG)
    probe.put(make("resp_0"))
    size = backend.held()["resp_0"]  # all ids have the same length
    probe.delete("resp_0")
    probe.close()

    store = backend.open(DAY, 3 * size)  # room for three
    now = time.time()
    # Put out of age order: eviction follows created_at, not the order of puts.
    for i in (2, 0, 1, 3):
        store.put(make(f"resp_{i}", created_at=now - 100 + i))
    assert set(backend.held()) == {"resp_1", "resp_2", "resp_3"}
    store.put(make("resp_4", created_at=now))
    assert set(backend.held()) == {"resp_2", "resp_3", "resp_4"}
    assert store.get("resp_4") is not None
    assert store.get("resp_1") is None
    assert backend.total_bytes() == 3 * size
    store.close()


def test_a_response_larger_than_the_bound_is_kept_alone(backend: Backend) -> None:
    store = backend.open(DAY, 10)
    store.put(make("resp_1"))
    store.put(make("resp_2"))
    assert set(backend.held()) == {"resp_2"}  # everything older went; the newest stays
    assert store.get("resp_2") is not None
    assert backend.total_bytes() == backend.held()["resp_2"] > 10
    # Even the oldest, when it is the one just put.
    store.put(make("resp_0", created_at=time.time() - 100))
    assert set(backend.held()) == {"resp_0"}
    store.close()


def test_concurrent_puts_and_gets_from_eight_threads(backend: Backend) -> None:
    store = backend.open(DAY, BIG)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            start.wait()
            for i in range(40):
                stored = make(f"resp_{t}_{i}", text=f"{t}:{i}")
                store.put(stored)
                got = store.get(stored.id)
                assert got is not None and got.response["output_text"] == f"{t}:{i}"
                if i % 4 == 0:
                    assert store.delete(stored.id) is True
        except BaseException as e:  # noqa: BLE001 - any failure in a thread fails the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(backend.held()) == 8 * 30
    assert backend.total_bytes() == sum(backend.held().values())
    store.close()


# --------------------------------------------------------------------------- SQLite's own


def test_json_is_stored_as_text_without_escapes(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = SQLiteResponseStore(path, DAY, BIG)
    store.put(make("resp_1"))
    store.close()
    with sqlite3.connect(path) as conn:
        (messages,) = conn.execute("SELECT messages FROM responses").fetchone()
    assert "Grüße, 世界" in messages  # ensure_ascii=False


def test_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.sqlite3"  # the folder is created
    store = SQLiteResponseStore(path, DAY, BIG)
    store.put(make("resp_1"))
    store.put(make("resp_2"))
    store.close()
    again = SQLiteResponseStore(path, DAY, BIG)
    got = again.get("resp_1")
    assert got is not None and got == make("resp_1", got.created_at)
    assert again.get("resp_2") is not None
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    on_disk = SQLiteBackend(path)
    assert on_disk.total_bytes() == sum(on_disk.held().values())
    again.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(ResponseStoreError, match="newer"):
        SQLiteResponseStore(path, DAY, BIG)


def test_none_stores_nothing(tmp_path: Path) -> None:
    store: ResponseStore = open_response_store("none", tmp_path, DAY, BIG)
    assert isinstance(store, NoResponseStore)
    store.put(make("resp_1"))
    assert store.get("resp_1") is None
    assert store.delete("resp_1") is False
    store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "spec", ["redis:/localhost", "memcached://x", "postgres://x", "SQLite", ""]
)
def test_an_unknown_spec_is_refused(tmp_path: Path, spec: str) -> None:
    with pytest.raises(ValueError, match=r"not supported: use .*'redis://host:port/db'"):
        open_response_store(spec, tmp_path, DAY, BIG)


@pytest.mark.parametrize("spec", ["sqlite://relative.sqlite3", "sqlite:///", "sqlite://"])
def test_a_sqlite_spec_needs_an_absolute_path(tmp_path: Path, spec: str) -> None:
    with pytest.raises(ValueError, match="absolute"):
        open_response_store(spec, tmp_path, DAY, BIG)


def test_an_unwritable_path_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    # A path under a file: refused even as root, for whom permissions are no obstacle.
    with pytest.raises(ResponseStoreError, match="responses store"):
        SQLiteResponseStore(blocker / "r.sqlite3", DAY, BIG)
    with pytest.raises(ResponseStoreError, match="responses store"):
        open_response_store(f"sqlite://{blocker}/r.sqlite3", tmp_path, DAY, BIG)
    # A folder where the file should be: sqlite cannot open it.
    (tmp_path / "dir.sqlite3").mkdir()
    with pytest.raises(ResponseStoreError, match="cannot open"):
        SQLiteResponseStore(tmp_path / "dir.sqlite3", DAY, BIG)


def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ResponseStoreError, match="cannot open"):
        SQLiteResponseStore(path, DAY, BIG)


def test_a_locked_file_is_a_store_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("server.openai.responses.store.sqlite._BUSY_TIMEOUT_S", 0.01)
    path = tmp_path / "r.sqlite3"
    store = SQLiteResponseStore(path, DAY, BIG)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
    try:
        with pytest.raises(ResponseStoreError, match="cannot write"):
            store.put(make("resp_1"))
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.put(make("resp_1"))  # the failed put left the store usable
    assert store.get("resp_1") is not None
    store.close()


def test_sqlite_spec_puts_the_file_in_the_cache_dir(tmp_path: Path) -> None:
    store = open_response_store("sqlite", tmp_path / "cache", DAY, BIG)
    assert isinstance(store, SQLiteResponseStore)
    store.put(make("resp_1"))
    store.close()
    assert "resp_1" in rows(tmp_path / "cache" / "responses.sqlite3")


def test_sqlite_url_spec_uses_that_file(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere" / "mine.sqlite3"
    store = open_response_store(f"sqlite://{path}", tmp_path / "cache", DAY, BIG)
    store.put(make("resp_1"))
    store.close()
    assert "resp_1" in rows(path)
    assert not (tmp_path / "cache").exists()


def test_config_fields_and_their_bounds() -> None:
    config = ServerConfig()
    assert config.responses_store == "sqlite"
    assert config.responses_max_age_s == 30 * DAY
    assert config.responses_max_bytes == 1 << 30
    with pytest.raises(ValueError):
        ServerConfig(responses_max_age_s=0)
    with pytest.raises(ValueError):
        ServerConfig(responses_max_bytes=0)


def test_config_fields_are_flags() -> None:
    from config.sources import serve_config
    from server import cli

    argv = ["serve", "--responses-store", "none", "--responses-max-age-s", "5"]
    args = vars(cli.build_parser().parse_args([*argv, "--responses-max-bytes", "100"]))
    del args["command"], args["config"]
    config = serve_config(args, {})
    assert config.server.responses_store == "none"
    assert config.server.responses_max_age_s == 5.0
    assert config.server.responses_max_bytes == 100
    env = {"PAGEDSERVE_RESPONSES_STORE": "sqlite:///tmp/x.sqlite3"}
    assert serve_config({}, env).server.responses_store == "sqlite:///tmp/x.sqlite3"


def test_help_documents_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from server import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in ("responses_store", "responses_max_age_s", "responses_max_bytes"):
        description = ServerConfig.model_fields[name].description
        assert "".join(str(description).split()) in text, name
        assert f"PAGEDSERVE_{name.upper()}" in text, name
