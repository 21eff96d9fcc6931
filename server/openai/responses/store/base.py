"""What every response store keeps and promises (`ResponseStore`), the store that keeps nothing,
and the JSON encoding that every backend stores, so that `max_bytes` means the same whatever
keeps the responses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from server.errors import ResponseStoreError


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
