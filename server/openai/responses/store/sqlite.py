"""A `ResponseStore` in one SQLite file (stdlib `sqlite3`): the default, so that a single server
needs no other service and a restart does not lose the conversations clients hold ids for."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from server.errors import ResponseStoreError
from server.openai.responses.store.base import StoredResponse, decode_stored, encode_stored

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
