"""The response store backends under test, each with a look behind the store's back at what it
holds, so that one set of contract tests (tests/server/responses/test_responses_store.py) runs on every backend."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Protocol, cast

from redis import Redis

from server.openai.responses.store import ResponseStore, SQLiteResponseStore, StoredResponse
from server.openai.responses.store.redis import (
    BYTES_KEY,
    INDEX_KEY,
    ITEM_PREFIX,
    SIZES_KEY,
    RedisResponseStore,
)

DAY = 24 * 3600.0
BIG = 1 << 30


def make(response_id: str, created_at: float | None = None, text: str = "hi") -> StoredResponse:
    return StoredResponse(
        id=response_id,
        created_at=time.time() if created_at is None else created_at,
        response={"id": response_id, "object": "response", "output_text": text, "n": 1.5},
        input_items=[{"id": f"msg_{response_id}", "type": "message", "role": "user"}],
        messages=[
            {"role": "user", "content": "Grüße, 世界"},
            {"role": "assistant", "content": text},
        ],
    )


def json_size(stored: StoredResponse) -> int:
    """What the size bound counts for `stored`: the UTF-8 bytes of its compact JSON (non-ASCII
    text as itself), worked out here independently of the stores."""

    def size(value: Any) -> int:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))

    return size(stored.response) + size(stored.input_items) + size(stored.messages)


class Backend(Protocol):
    """Where a test's stores keep their responses: every `open` reaches the same place."""

    def open(self, max_age_s: float, max_bytes: int) -> ResponseStore:
        """A store on this backend (the tests close it)."""
        ...

    def held(self) -> dict[str, int]:
        """What the backend holds, read behind the store's back: id -> size."""
        ...

    def total_bytes(self) -> int:
        """The store's running byte total, as the backend holds it."""
        ...

    def close(self) -> None:
        """Release what looking behind the store's back took."""
        ...


class SQLiteBackend:
    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, max_age_s: float, max_bytes: int) -> SQLiteResponseStore:
        return SQLiteResponseStore(self.path, max_age_s, max_bytes)

    def held(self) -> dict[str, int]:
        with sqlite3.connect(self.path) as conn:
            return dict(conn.execute("SELECT id, size FROM responses").fetchall())

    def total_bytes(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT total_bytes FROM usage").fetchone()[0])

    def close(self) -> None:
        pass


class RedisBackend:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = Redis.from_url(url, decode_responses=True)

    def open(self, max_age_s: float, max_bytes: int) -> RedisResponseStore:
        return RedisResponseStore(self.url, max_age_s, max_bytes)

    def held(self) -> dict[str, int]:
        """The items there are; the index and the sizes must name exactly those (an expired
        item's entries stay until the next put or delete, so call this after one)."""
        items = {key.removeprefix(ITEM_PREFIX) for key in self.client.scan_iter(ITEM_PREFIX + "*")}
        index = set(self.client.zrange(INDEX_KEY, 0, -1))
        raw_sizes = cast("dict[str, str]", self.client.hgetall(SIZES_KEY))  # decode_responses
        sizes = {response_id: int(size) for response_id, size in raw_sizes.items()}
        assert items == index == set(sizes), (items, index, sizes)
        return sizes

    def total_bytes(self) -> int:
        return int(self.client.get(BYTES_KEY) or 0)

    def close(self) -> None:
        self.client.close()
