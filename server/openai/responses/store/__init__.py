"""Where `POST /v1/responses` with `store: true` keeps its responses, so that a later request can
continue one (`previous_response_id`) and clients can fetch or delete it by id.

By default the store is embedded (stdlib `sqlite3`, one file) so that a single server needs no
other service, and a restart does not lose the conversations clients hold ids for; replicas behind
one load balancer share a Redis server instead (`redis.py`). It is bounded
by age and by size, because clients never have to delete what they stored and a long-running
server must not fill its disk. The routes call it from worker threads (`asyncio.to_thread`),
several at once.
"""

from __future__ import annotations

from pathlib import Path

from server.errors import ResponseStoreError
from server.openai.responses.store.base import (
    NoResponseStore,
    ResponseStore,
    StoredResponse,
)
from server.openai.responses.store.sqlite import SQLITE_FILE_NAME, SQLiteResponseStore

__all__ = [
    "NoResponseStore",
    "ResponseStore",
    "ResponseStoreError",
    "SQLiteResponseStore",
    "StoredResponse",
    "open_response_store",
]

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
        from server.openai.responses.store.redis import RedisResponseStore

        return RedisResponseStore(spec, max_age_s, max_bytes)
    raise ValueError(
        f"--responses-store {spec!r} is not supported: use 'sqlite', "
        "'sqlite:///abs/path.sqlite3', 'redis://host:port/db' (or rediss://, unix://) or 'none'"
    )
