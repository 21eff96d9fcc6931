"""Server-sent events, fan-in of several engine requests, and client disconnects.

A streaming client that goes away is noticed by Starlette's StreamingResponse (it listens for
the disconnect and cancels the body). A non-streaming one is noticed by `until_disconnected`.
Either way the cancellation reaches the engine stream (`EngineClient.submit`), whose exit
aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import TypeVar, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from server.errors import as_api_error

T = TypeVar("T")
log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client of a whole (non-streamed) answer left before it was ready."""


# Nginx's "client closed request": nobody reads it, but the access log shows what happened.
CLIENT_CLOSED_REQUEST = 499


async def client_gone(request: Request, exc: Exception) -> Response:
    """A client that leaves is no server error: its request is already aborted, so one line at
    info, not the traceback of an unhandled exception."""
    log.info("%s %s: the client left before its answer; aborted", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One event, exactly `data: <json>\\n\\n` (JSON escapes newlines, so one line)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


def event_stream(events: AsyncGenerator[str, None]) -> StreamingResponse:
    """A streamed answer: `events`, then `[DONE]`."""
    return StreamingResponse(_ending_with_done(events), media_type="text/event-stream")


async def _ending_with_done(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    # Once the first event is sent the status is 200 for good, so a failure mid-stream (the
    # engine died) is told in the stream: an OpenAI error event, then [DONE] as always.
    async with aclosing(events):  # closing it now aborts the engine requests behind it
        try:
            async for event in events:
                yield event
        except Exception as exc:  # noqa: BLE001 - whatever failed, the client gets an error event
            yield sse(as_api_error(exc).body())
    yield DONE


_END = object()


async def merge(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all iterators as they come, tagged with the iterator's index. Leaving early,
    or a failure of one, cancels the others (which aborts their engine requests)."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    inbox: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                inbox.put_nowait((index, item, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer, below
            inbox.put_nowait((index, _END, exc))
        else:
            inbox.put_nowait((index, _END, None))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, got, error = await inbox.get()
            if error is not None:
                raise error
            if got is _END:
                remaining -= 1
                continue
            yield index, cast(T, got)  # not _END: an item that pump() put there
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    # After the body is read, the server's receive() only returns once the client is gone.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def last_output(outputs: AsyncIterator[T]) -> T:
    """The last of `outputs`: a whole (non-streamed) answer is the final state of its request."""
    final = None
    async for output in outputs:
        final = output
    assert final is not None
    return final


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (and raise ClientDisconnected) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientDisconnected()
