"""Where `POST /v1/responses` with `store: true` keeps its responses, so that a later request can
continue one (`previous_response_id`) and clients can fetch or delete it by id.

By default the store is embedded (stdlib `sqlite3`, one file) so that a single server needs no
other service, and a restart does not lose the conversations clients hold ids for; replicas behind
one load balancer share a Redis server instead (server/responses_store_redis.py). It is bounded
by age and by size, because clients never have to delete what they stored and a long-running
server must not fill its disk. The routes call it from worker threads (`asyncio.to_thread`),
several at once.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

# Bumped whenever the schema changes; a file written by a newer version is refused rather than
# misread.
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
-- The running total of `size`, kept by triggers so that the size bound costs O(1) per put
-- instead of a scan of every row.
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    total_bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO usage (id, total_bytes) VALUES (0, 0);
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses BEGIN
    UPDATE usage SET total_bytes = total_bytes + NEW.size WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses BEGIN
    UPDATE usage SET total_bytes = total_bytes - OLD.size WHERE id = 0;
END;
"""

# How long a write waits for another process's lock on the same file before it gives up.
_BUSY_TIMEOUT_S = 5.0


class ResponseStoreError(RuntimeError):
    """The store cannot be opened, read or written (unwritable path, disk full, locked, corrupt).

    A server-side condition, not the client's fault: the routes answer it with 503."""


@dataclass(frozen=True)
class StoredResponse:
    """One stored response, with what a continuation and the input_items route need, so that
    neither has to re-derive them from the response object.

    `messages` is the whole conversation so far as chat messages (the earlier turns, this input
    and this output): a request with `previous_response_id` renders it plus its own input, without
    walking the chain of earlier responses (which may have been evicted)."""

    id: str
    created_at: float  # seconds since the epoch; the age bound counts from it
    response: dict[str, Any]  # the response object as returned to the client (JSON-able)
    input_items: list[dict[str, Any]]  # the request's input items, each with an "id"
    messages: list[dict[str, Any]]  # the conversation so far as chat messages (input + output)


class ResponseStore(Protocol):
    """What the routes use, whatever keeps the responses (a file, a Redis server shared by
    replicas, nothing). Every method may block: call it off the event loop."""

    def put(self, stored: StoredResponse) -> None:
        """Store `stored`, replacing any response with its id."""
        ...

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when it was never stored, was deleted or has expired."""
        ...

    def delete(self, response_id: str) -> bool:
        """Delete a response; False when there was none to delete (so the route can answer 404)."""
        ...

    def close(self) -> None:
        """Release the store's resources; idempotent."""
        ...


class NoResponseStore:
    """`--responses-store none`: stores nothing, for deployments that must not keep
    conversations. `store: true` is then accepted but nothing can be fetched or continued."""

    def put(self, stored: StoredResponse) -> None:
        """Keep nothing."""

    def get(self, response_id: str) -> StoredResponse | None:
        """Nothing was stored, so nothing is found."""
        return None

    def delete(self, response_id: str) -> bool:
        """Nothing was stored, so there is nothing to delete."""
        return False

    def close(self) -> None:
        """Nothing to release."""


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, taken at once (IMMEDIATE) so that it waits for another writer up
    front instead of failing half-way; rolled back on any error, unless sqlite already did so
    (disk full), where a second ROLLBACK would hide the first error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _dumps(value: object) -> str:
    # ensure_ascii=False: non-ASCII text is stored as itself, not as \\u escapes six bytes each.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class EncodedResponse(NamedTuple):
    """A `StoredResponse`'s JSON columns as every backend stores them, and their size, which the
    size bound counts: the same bytes whatever the backend, so `max_bytes` means the same."""

    response: str
    input_items: str
    messages: str
    size: int  # UTF-8 bytes of the three texts


def encode_stored(stored: StoredResponse) -> EncodedResponse:
    """The JSON texts a backend stores for `stored`."""
    response = _dumps(stored.response)
    input_items = _dumps(stored.input_items)
    messages = _dumps(stored.messages)
    size = sum(len(text.encode("utf-8")) for text in (response, input_items, messages))
    return EncodedResponse(response, input_items, messages, size)


def decode_stored(
    response_id: str,
    created_at: float,
    response: str,
    input_items: str,
    messages: str,
    where: str,
) -> StoredResponse:
    """The `StoredResponse` that `encode_stored` wrote; JSON that does not parse (a store
    written by something else) is the store's failure, named by `where`."""
    try:
        return StoredResponse(
            id=response_id,
            created_at=created_at,
            response=json.loads(response),
            input_items=json.loads(input_items),
            messages=json.loads(messages),
        )
    except ValueError as e:
        raise ResponseStoreError(
            f"the responses store {where} holds unreadable JSON for {response_id}: {e}"
        ) from e


class SQLiteResponseStore:
    """A `ResponseStore` in one SQLite file.

    One connection behind a lock: every call is short (one row by primary key, or a few deletes),
    so serializing them costs little and keeps sqlite's threading rules out of the picture. WAL
    mode lets other processes on the same file read while this one writes.

    Bounds, applied on every `put` so that no background task is needed: rows older than
    `max_age_s` are deleted (an indexed range delete), then, while the stored JSON exceeds
    `max_bytes` (UTF-8 bytes), the oldest rows are deleted. The row just put is never evicted by
    the size bound, so that a response the client was just told is stored can be continued: the
    total may exceed `max_bytes` by at most that one row. `get` never returns an expired row, even
    one that no `put` has deleted yet.
    """

    def __init__(self, path: Path, max_age_s: float, max_bytes: int) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.path = path
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ResponseStoreError(
                f"cannot create the folder of the responses store {path}: {e}"
            ) from e
        try:
            # isolation_level=None: transactions are begun explicitly, so each put is exactly one.
            conn = sqlite3.connect(
                path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise ResponseStoreError(f"cannot open the responses store {path}: {e}") from e
        try:
            self._init_schema(conn)
        except sqlite3.Error as e:
            conn.close()
            raise ResponseStoreError(f"cannot open the responses store {path}: {e}") from e
        except ResponseStoreError:
            conn.close()
            raise
        self._conn = conn

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL cannot corrupt the file; a power cut may lose the last few puts.
        conn.execute("PRAGMA synchronous=NORMAL")
        with _transaction(conn):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ResponseStoreError(
                    f"the responses store {self.path} has schema version {version}, newer than "
                    f"this server's {SCHEMA_VERSION}: use a newer server or another file"
                )
            for statement in _split_sql(_SCHEMA):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ResponseStoreError(f"the responses store {self.path} is closed")
        return self._conn

    def put(self, stored: StoredResponse) -> None:
        """Store `stored` (replacing its id), then apply the age and size bounds, in one
        transaction: a failure leaves the store as it was."""
        response, input_items, messages, size = encode_stored(stored)
        with self._lock:
            conn = self._connection()
            try:
                with _transaction(conn):
                    # DELETE then INSERT, not INSERT OR REPLACE: REPLACE's implicit delete does
                    # not fire the trigger that keeps the byte total.
                    conn.execute("DELETE FROM responses WHERE id = ?", (stored.id,))
                    conn.execute(
                        "INSERT INTO responses (id, created_at, response, input_items, messages, "
                        "size) VALUES (?, ?, ?, ?, ?, ?)",
                        (stored.id, stored.created_at, response, input_items, messages, size),
                    )
                    conn.execute(
                        "DELETE FROM responses WHERE created_at < ? AND id != ?",
                        (time.time() - self.max_age_s, stored.id),
                    )
                    self._evict_to_size(conn, keep=stored.id)
            except sqlite3.Error as e:
                raise ResponseStoreError(
                    f"cannot write to the responses store {self.path}: {e}"
                ) from e

    def _evict_to_size(self, conn: sqlite3.Connection, keep: str) -> None:
        total = conn.execute("SELECT total_bytes FROM usage WHERE id = 0").fetchone()[0]
        if total <= self.max_bytes:
            return
        victims: list[tuple[str]] = []
        cursor = conn.execute(
            "SELECT id, size FROM responses WHERE id != ? ORDER BY created_at, rowid", (keep,)
        )
        for response_id, size in cursor:
            if total <= self.max_bytes:
                break
            victims.append((response_id,))
            total -= size
        cursor.close()
        conn.executemany("DELETE FROM responses WHERE id = ?", victims)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when absent or older than `max_age_s`."""
        with self._lock:
            conn = self._connection()
            try:
                row = conn.execute(
                    "SELECT created_at, response, input_items, messages FROM responses "
                    "WHERE id = ? AND created_at >= ?",
                    (response_id, time.time() - self.max_age_s),
                ).fetchone()
            except sqlite3.Error as e:
                raise ResponseStoreError(f"cannot read the responses store {self.path}: {e}") from e
        if row is None:
            return None
        created_at, response, input_items, messages = row
        return decode_stored(
            response_id, created_at, response, input_items, messages, where=str(self.path)
        )

    def delete(self, response_id: str) -> bool:
        """Delete the response; False when there was none, or only an expired one (which `get`
        already reported as absent, so the answers agree)."""
        with self._lock:
            conn = self._connection()
            try:
                with _transaction(conn):
                    row = conn.execute(
                        "SELECT created_at FROM responses WHERE id = ?", (response_id,)
                    ).fetchone()
                    conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            except sqlite3.Error as e:
                raise ResponseStoreError(
                    f"cannot write to the responses store {self.path}: {e}"
                ) from e
        return row is not None and row[0] >= time.time() - self.max_age_s

    def close(self) -> None:
        """Close the connection; later calls raise ResponseStoreError. Idempotent."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _split_sql(script: str) -> list[str]:
    """The statements of `script`, executed one by one so that they share the caller's
    transaction (`executescript` would commit first). Trigger bodies hold `;` of their own, so
    complete statements are found with sqlite's own parser."""
    statements: list[str] = []
    current = ""
    for line in script.splitlines(keepends=True):
        if line.lstrip().startswith("--"):
            continue
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    if current.strip():
        statements.append(current.strip())
    return statements


SQLITE_FILE_NAME = "responses.sqlite3"

# The URL schemes redis-py's `Redis.from_url` accepts: TCP, TLS, and a Unix socket.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_response_store(
    spec: str, cache_dir: Path, max_age_s: float, max_bytes: int
) -> ResponseStore:
    """The store that `--responses-store SPEC` names.

    `sqlite`: `<cache_dir>/responses.sqlite3`, next to the converted models, so that a default
    server keeps its conversations across restarts with no setting. `sqlite:///abs/path.sqlite3`:
    that file. `redis://host:port/db` (or `rediss://`, `unix:///path.sock`): a Redis server, so
    that replicas behind one load balancer share their stored responses. `none`: nothing is
    stored. Anything else raises ValueError at start-up rather than at the first `store: true`
    request.
    """
    if spec == "none":
        return NoResponseStore()
    if spec == "sqlite":
        return SQLiteResponseStore(cache_dir / SQLITE_FILE_NAME, max_age_s, max_bytes)
    if spec.startswith("sqlite://"):
        path = spec.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise ValueError(
                f"--responses-store {spec!r}: a sqlite store needs an absolute file path, "
                "as in sqlite:///var/lib/pagedserve/responses.sqlite3"
            )
        return SQLiteResponseStore(Path(path), max_age_s, max_bytes)
    if spec.startswith(REDIS_SCHEMES):
        # Imported here: the redis package is needed only by servers that use it.
        from server.responses_store_redis import RedisResponseStore

        return RedisResponseStore(spec, max_age_s, max_bytes)
    raise ValueError(
        f"--responses-store {spec!r} is not supported: use 'sqlite', "
        "'sqlite:///abs/path.sqlite3', 'redis://host:port/db' (or rediss://, unix://) or 'none'"
    )
