"""A `ResponseStore` on a Redis server, so that several replicas behind one load balancer share
their stored responses: a response stored through one replica can be fetched, continued or
deleted through any other.

It keeps the SQLite store's contract (`sqlite.py`): bounded by age and by size,
oldest evicted first, the response just put never evicted, `get` never returning an expired one,
every failure a `ResponseStoreError` (which the routes answer with 503).

Layout, every key under `KEY_PREFIX`:

- `item:<id>`: a hash with `created_at` and the three JSON texts, expiring (PEXPIREAT) at
  `created_at + max_age_s`, so that Redis itself drops old responses with no task of ours;
- `by_age`: a sorted set of ids scored by `created_at`, the order of eviction;
- `sizes`: a hash id -> bytes, which outlives the item, so that an expired item's bytes can still
  be taken off the total;
- `total_bytes`: the running total of `sizes`, so the size bound costs O(1) per put.

`put` and `delete` are Lua scripts, so that the item, the index and the total change together
even with several replicas writing at once. The scripts name the keys of evicted items themselves,
which standalone Redis allows (Redis Cluster would not). Redis should run with a `maxmemory-policy`
of `noeviction` or a `volatile-*` one: the items carry expiries, the index does not, and losing the
index to an `allkeys-*` policy would let the byte total drift.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from server.errors import ResponseStoreError
from server.openai.responses.store.base import StoredResponse, decode_stored, encode_stored

KEY_PREFIX = "pagedserve:responses:"
ITEM_PREFIX = KEY_PREFIX + "item:"
INDEX_KEY = KEY_PREFIX + "by_age"
SIZES_KEY = KEY_PREFIX + "sizes"
BYTES_KEY = KEY_PREFIX + "total_bytes"

T = TypeVar("T")

# Short, so that a store that is down or hung fails a request with 503 in seconds instead of
# holding it: a connect is answered at once on a working network, and every command here touches
# a few keys (a put after a long idle may walk many expired index entries, hence more to read).
_CONNECT_TIMEOUT_S = 3.0
_READ_TIMEOUT_S = 5.0

# Expiries past this (the year 9999) are clamped: Redis refuses times it cannot hold, and a
# `max_age_s` that large means "keep until the size bound evicts".
_LAST_EXPIRY_S = 253402300799.0

_ITEM_FIELDS = ("created_at", "response", "input_items", "messages")

# KEYS: item, index, sizes, total. ARGV: id, created_at, response, input_items, messages, size,
# expire_at_ms, max_bytes, item key prefix. Returns the byte total after the bounds.
_PUT_LUA = """
local id = ARGV[1]
local total
local function forget(member)
  local size = redis.call('HGET', KEYS[3], member)
  redis.call('ZREM', KEYS[2], member)
  redis.call('HDEL', KEYS[3], member)
  if size then total = redis.call('DECRBY', KEYS[4], size) end
end

-- Replace: the old version's bytes leave the total before the new one's enter.
forget(id)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'created_at', ARGV[2], 'response', ARGV[3],
           'input_items', ARGV[4], 'messages', ARGV[5])
-- A time already past deletes the item at once: it was expired when put.
redis.call('PEXPIREAT', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[2], id)
redis.call('HSET', KEYS[3], id, ARGV[6])
total = redis.call('INCRBY', KEYS[4], ARGV[6])

-- Items Redis expired (or deleted for want of memory): their index entries and bytes. Items
-- expire in index order, so those are the oldest entries, up to the first item still there.
while true do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest or redis.call('EXISTS', ARGV[9] .. oldest) == 1 then break end
  forget(oldest)
end

-- The size bound: the oldest go first, never the one just put.
local max_bytes = tonumber(ARGV[8])
local rank = 0
while total > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[2], rank, rank)[1]
  if not oldest then break end
  if oldest == id then
    rank = rank + 1
  else
    redis.call('DEL', ARGV[9] .. oldest)
    forget(oldest)
  end
end
return total
"""

# KEYS: item, index, sizes, total. ARGV: id. Returns the deleted item's created_at, or nil when
# there was no item (never stored, deleted, or expired: its index entry and bytes go all the same).
_DELETE_LUA = """
local created_at = redis.call('HGET', KEYS[1], 'created_at')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return created_at
"""


def redacted(url: str) -> str:
    """`url` with its password replaced by `***` (in the user part or a `password=` query
    option), so that it can be named in errors and logs."""
    parts = urlsplit(url)
    options = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(name.lower() == "password" for name, _ in options):
        return url
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{host}"
    query = urlencode(
        [(name, "***" if name.lower() == "password" else value) for name, value in options],
        safe="*/",
    )
    # Put together by hand: urlunsplit drops the `//` of unix:///path, whose host is empty.
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _secrets(url: str) -> list[str]:
    """The passwords in `url`, as written and as redis-py decodes them, longest first (so that
    one containing another is hidden whole)."""
    parts = urlsplit(url)
    found = {parts.password or "", unquote(parts.password or "")}
    found.update(value for name, value in parse_qsl(parts.query) if name.lower() == "password")
    return sorted((secret for secret in found if secret), key=len, reverse=True)


class RedisResponseStore:
    """A `ResponseStore` on the Redis server at `url` (`redis://`, `rediss://` or `unix://`, as
    redis-py's `Redis.from_url` reads them, query options included).

    redis-py's client holds a pool of connections and is safe to share between threads, so the
    routes' worker threads call it at once with no lock of ours. A failed command is not retried:
    the request fails with 503 at once (a dead pooled connection is replaced when it is next taken
    from the pool, so a Redis restart costs no request beyond those it interrupted).

    The age bound is kept by Redis (key expiry) and by `get`, which also compares `created_at`
    with this server's clock: where Redis's clock runs behind it, Redis still holds responses this
    server counts as expired, and those are not returned.
    """

    def __init__(self, url: str, max_age_s: float, max_bytes: int) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.url = redacted(url)
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._secrets = _secrets(url)
        self._close_lock = threading.Lock()
        try:
            client = Redis.from_url(
                url,
                decode_responses=True,
                socket_connect_timeout=_CONNECT_TIMEOUT_S,
                socket_timeout=_READ_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as e:
            # A URL redis-py cannot read (a port that is not a number, an unknown option value):
            # a bad setting, refused at start-up like any other bad --responses-store.
            raise ValueError(f"the responses store URL {self.url} is not valid: {e}") from None
        # Script objects load themselves into Redis's script cache on first use and again after
        # a restart emptied it (EVALSHA, then SCRIPT LOAD on NOSCRIPT).
        self._put_script = client.register_script(_PUT_LUA)
        self._delete_script = client.register_script(_DELETE_LUA)
        self._client: Redis | None = client
        try:
            self._call("reach", client.ping)
        except ResponseStoreError:
            self.close()
            raise

    def _live(self) -> Redis:
        client = self._client
        if client is None:
            raise ResponseStoreError(f"the responses store {self.url} is closed")
        return client

    def _call(self, doing: str, command: Callable[..., T], *args: object, **kwargs: object) -> T:
        """`command(*args, **kwargs)`, any Redis failure a ResponseStoreError naming the URL.

        `from None`: the message already says what failed, and the password must not reach the
        logs through a chained exception either."""
        try:
            return command(*args, **kwargs)
        except RedisError as e:
            message = str(e) or "no detail"
            for secret in self._secrets:
                message = message.replace(secret, "***")
            raise ResponseStoreError(
                f"cannot {doing} the responses store {self.url}: {type(e).__name__}: {message}"
            ) from None

    def put(self, stored: StoredResponse) -> None:
        """Store `stored` (replacing its id), then apply the age and size bounds, atomically."""
        encoded = encode_stored(stored)
        expire_at_s = min(stored.created_at + self.max_age_s, _LAST_EXPIRY_S)
        client = self._live()
        self._call(
            "write to",
            self._put_script,
            keys=[ITEM_PREFIX + stored.id, INDEX_KEY, SIZES_KEY, BYTES_KEY],
            # repr: the shortest text that reads back as the same float, so that `get` returns
            # the `created_at` that was put, exactly.
            args=[
                stored.id,
                repr(stored.created_at),
                encoded.response,
                encoded.input_items,
                encoded.messages,
                encoded.size,
                math.ceil(expire_at_s * 1000),
                self.max_bytes,
                ITEM_PREFIX,
            ],
            client=client,
        )

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when absent or older than `max_age_s`."""
        client = self._live()
        fields = cast(
            "list[str | None]",
            self._call("read", client.hmget, ITEM_PREFIX + response_id, list(_ITEM_FIELDS)),
        )
        created_text, response, input_items, messages = fields
        if created_text is None or response is None or input_items is None or messages is None:
            return None  # never stored, deleted, or expired (Redis dropped the whole hash)
        created_at = self._created_at(response_id, created_text)
        if created_at < time.time() - self.max_age_s:
            return None
        return decode_stored(
            response_id, created_at, response, input_items, messages, where=self.url
        )

    def delete(self, response_id: str) -> bool:
        """Delete the response; False when there was none, or only an expired one (which `get`
        already reported as absent, so the answers agree)."""
        client = self._live()
        created_text = self._call(
            "write to",
            self._delete_script,
            keys=[ITEM_PREFIX + response_id, INDEX_KEY, SIZES_KEY, BYTES_KEY],
            args=[response_id],
            client=client,
        )
        if created_text is None:
            return False
        created_at = self._created_at(response_id, cast(str, created_text))
        return created_at >= time.time() - self.max_age_s

    def _created_at(self, response_id: str, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise ResponseStoreError(
                f"the responses store {self.url} holds an unreadable created_at for "
                f"{response_id}: {text!r}"
            ) from None

    def close(self) -> None:
        """Close the connections; later calls raise ResponseStoreError. Idempotent."""
        with self._close_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
