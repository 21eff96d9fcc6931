"""Streamed HTTP/1.1 POSTs over keep-alive connections, read with as little client CPU as a
Python client can spend.

A load generator on the server's own machine takes CPU the server would otherwise have. On a
2-core machine whose engine runs every op on both cores (fork, then join), each slice a client
takes from one core stalls the other core's half at the next join, so a client's CPU costs the
server about as much wall time as it uses. httpx spent ~200 us of CPU per streamed token here
(async generators over httpcore and anyio for every chunk): 8% of a 2-core machine at 400 tok/s.
This reads each socket into one reused buffer (`asyncio.BufferedProtocol`) and frames chunks and
events where they land, so an event costs one callback and no task switch. Connections are kept
alive and reused as the OpenAI SDKs do: a connection per request spread a closed loop's requests
out in time (connect and accept for each), which changed how a server batched them.

    client = SSEClient("http://127.0.0.1:8000/v1/completions")
    end = await client.post(body, on_data)  # on_data(payload): each `data:` of a 200, [DONE] too
    client.close()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

_READ_SIZE = 64 * 1024


@dataclass
class StreamEnd:
    status: int
    done: bool  # a 200 answer whose stream had `data: [DONE]`
    body: bytes  # the body of an answer other than 200 (a 200's events went to on_data)


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection carrying one request at a time. Its answer is parsed as it
    arrives: the head, the body's framing (chunked, Content-Length or until close), then the
    server-sent events of a 200."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._read = bytearray(_READ_SIZE)  # where the transport reads into
        self._raw = bytearray()  # bytes received and not yet framed
        self.closed = False
        self.reusable = False  # the last answer ended cleanly, and the server keeps the connection
        self.answered = False  # a byte of the current answer arrived
        self._start_answer(lambda _: None)
        self.ended.set_result(StreamEnd(0, False, b""))  # no request yet, so none to answer

    def _start_answer(self, on_data: Callable[[bytes], None]) -> None:
        loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[StreamEnd] = loop.create_future()
        self._on_data = on_data
        self._body = bytearray()  # body bytes not yet split into events (or an error's body)
        self._status: int | None = None
        self._keep_alive = True
        self._chunked = False
        self._left: int | None = None  # Content-Length bytes still to come (None: until close)
        self._chunk_left = 0  # of the current chunk's data; -1: its CRLF next; -2: trailers next
        self._done = False

    def send(self, request: bytes, on_data: Callable[[bytes], None]) -> asyncio.Future[StreamEnd]:
        assert self._transport is not None and not self.closed
        self._start_answer(on_data)
        self.reusable = self.answered = False
        self._transport.write(request)
        return self.ended

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self._transport is not None:
            self._transport.close()

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._read)

    def buffer_updated(self, nbytes: int) -> None:
        self.answered = True
        if self.ended.done():
            return  # bytes after an answer, or after a failed one: the connection is not reused
        self._raw += memoryview(self._read)[:nbytes]
        try:
            self._advance()
        except Exception as exc:  # noqa: BLE001 - a malformed answer (or on_data's error) ends it
            self._fail(exc)

    def eof_received(self) -> bool:
        self._at_close()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._at_close(exc)

    # ------------------------------------------------------------------ parsing

    def _at_close(self, exc: Exception | None = None) -> None:
        self.closed = True
        self.reusable = False
        if self.ended.done():
            return
        if self._status is not None and not self._chunked and self._left is None:
            self._body_ended()  # a body without framing ends where the connection does
        else:
            self._fail(exc or ConnectionError("the connection closed before the answer ended"))

    def _advance(self) -> None:
        if self._status is None and not self._read_head():
            return
        if self._frame_body():
            self._body_ended()
        elif self._status == 200:
            self._split_events()

    def _read_head(self) -> bool:
        end = self._raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self._raw[:end]).decode("latin-1").split("\r\n")
        del self._raw[: end + 4]
        self._status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self._keep_alive = headers.get("connection") != "close"
        self._chunked = "chunked" in headers.get("transfer-encoding", "")
        if not self._chunked and "content-length" in headers:
            self._left = int(headers["content-length"])
        return True

    def _frame_body(self) -> bool:
        """Move body bytes from _raw to _body; true once the body is complete."""
        raw = self._raw
        if not self._chunked:
            take = len(raw) if self._left is None else min(len(raw), self._left)
            self._body += raw[:take]
            del raw[:take]
            if self._left is None:
                return False
            self._left -= take
            return self._left == 0
        while True:
            if self._chunk_left > 0:
                take = min(len(raw), self._chunk_left)
                self._body += raw[:take]
                del raw[:take]
                self._chunk_left -= take
                if self._chunk_left > 0:
                    return False
                self._chunk_left = -1
            if self._chunk_left == -1:
                if len(raw) < 2:
                    return False
                if raw[:2] != b"\r\n":
                    raise ValueError("a chunk of the answer does not end with CRLF")
                del raw[:2]
                self._chunk_left = 0
            if self._chunk_left == -2:  # after the last chunk: trailers, then an empty line
                end = 0 if raw.startswith(b"\r\n") else raw.find(b"\r\n\r\n")
                if end < 0:
                    return False
                del raw[: end + (2 if end == 0 else 4)]
                return True
            line_end = raw.find(b"\r\n")
            if line_end < 0:
                return False
            size = int(bytes(raw[:line_end]).split(b";")[0], 16)
            del raw[: line_end + 2]
            self._chunk_left = size if size else -2

    def _split_events(self) -> None:
        body = self._body
        while (end := body.find(b"\n\n")) >= 0:
            event = bytes(body[:end])
            del body[: end + 2]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments, event names, ids
                payload = line[5:].strip()
                if not self._done:  # (nothing is meant to follow [DONE])
                    self._done = payload == b"[DONE]"
                    self._on_data(payload)

    def _body_ended(self) -> None:
        assert self._status is not None
        if self._status == 200:
            self._split_events()
        body = b"" if self._status == 200 else bytes(self._body)
        self.reusable = self._keep_alive and not self.closed and not self._raw
        self.ended.set_result(StreamEnd(self._status, self._done, body))

    def _fail(self, error: BaseException) -> None:
        if not self.ended.done():
            self.ended.set_exception(error)
        self.close()


class SSEClient:
    """Streamed POSTs to one URL over a pool of keep-alive connections: as many connections
    as requests in flight at once, each reused once its answer has ended."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        """`headers`: sent with every request (an Authorization header, for a server that asks
        for an API key)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"only http:// URLs are supported, not {url!r}")
        self._host, self._port = parts.hostname, parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self._head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{extra}Content-Length: "
        ).encode("latin-1")
        self._idle: list[_Connection] = []

    async def post(self, body: bytes, on_data: Callable[[bytes], None]) -> StreamEnd:
        """POST `body` (JSON) and read the answer, handing each `data:` payload of a 200 to
        `on_data` as it arrives, up to and including `[DONE]`. Raises OSError when the server cannot be reached or the
        connection drops, ValueError for an answer that is not HTTP/1.1; cancelling closes the
        connection."""
        request = self._head + b"%d\r\n\r\n%s" % (len(body), body)
        while self._idle:
            connection = self._idle.pop()
            if connection.closed:
                continue
            try:
                return await self._send(connection, request, on_data)
            except ConnectionError:
                if connection.answered:
                    raise
                # The server had closed this idle connection: send again on a fresh one.
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(_Connection, self._host, self._port)
        return await self._send(connection, request, on_data)

    async def _send(
        self, connection: _Connection, request: bytes, on_data: Callable[[bytes], None]
    ) -> StreamEnd:
        try:
            return await connection.send(request, on_data)
        finally:
            if connection.reusable:
                self._idle.append(connection)
            else:
                connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
