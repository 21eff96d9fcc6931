"""The serving benchmark's client (server/bench/sse_stream.py, server/bench/load.py): its HTTP framing
against answers cut at every byte, and a whole load against the real server over loopback,
whose counts must be exact."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable

import pytest

from server.bench.load import run_load
from server.bench.sse_stream import SSEClient, StreamEnd, _Connection
from tests.support.server_harness import RunningServer

EVENTS = [{"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo\n\nthere"}]}, {"usage": 2}]


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in EVENTS)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
# A comment line, then events split across chunks, [DONE] in a chunk of its own.
STREAM = b": keep-alive\n\n" + SSE
CHUNKED_200 = HEAD + _chunked(STREAM[:7], STREAM[7:40], STREAM[40:], b"data: [DONE]\n\n")


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True


def _feed(
    connection: _Connection, answer: bytes, cuts: list[int], close: bool = False
) -> tuple[list[bytes], StreamEnd | BaseException]:
    """One request on `connection`, its answer fed in pieces ending at `cuts`: the answer's
    data payloads and how it ended."""
    payloads: list[bytes] = []
    ended = connection.send(b"request", payloads.append)
    start = 0
    for end in [*cuts, len(answer)]:
        piece = answer[start:end]
        buffer = connection.get_buffer(len(piece))
        buffer[: len(piece)] = piece
        connection.buffer_updated(len(piece))
        start = end
    if close:
        connection.eof_received()
    assert ended.done()
    error = ended.exception()
    return payloads, error if error is not None else ended.result()


def _on_a_connection(check: Callable[[_Connection, _Transport], None]) -> None:
    async def run() -> None:
        connection = _Connection()
        transport = _Transport()
        connection.connection_made(transport)
        check(connection, transport)

    asyncio.run(run())


@pytest.mark.parametrize("step", [1, 2, 5, 13, 10_000])
def test_a_chunked_stream_gives_every_event_however_it_is_cut(step: int) -> None:
    def check(connection: _Connection, transport: _Transport) -> None:
        for _ in range(2):  # the second request reuses the kept-alive connection
            cuts = list(range(step, len(CHUNKED_200), step))
            payloads, end = _feed(connection, CHUNKED_200, cuts)
            assert [json.loads(p) for p in payloads[:-1]] == EVENTS
            assert payloads[-1] == b"[DONE]"
            assert end == StreamEnd(200, True, b"")
            assert connection.reusable and not transport.closed
        assert transport.written == b"request" * 2

    _on_a_connection(check)


def test_trailers_after_the_last_chunk_are_skipped() -> None:
    def check(connection: _Connection, transport: _Transport) -> None:
        answer = CHUNKED_200[:-2] + b"x-trailer: 1\r\n\r\n"
        _, end = _feed(connection, answer, [len(answer) - 3])
        assert end == StreamEnd(200, True, b"") and connection.reusable

    _on_a_connection(check)


def test_a_stream_whose_body_ends_without_done_is_not_done() -> None:
    def check(connection: _Connection, transport: _Transport) -> None:
        payloads, end = _feed(connection, HEAD + _chunked(SSE), [len(HEAD) + 3])
        assert len(payloads) == len(EVENTS)
        assert end == StreamEnd(200, False, b"")

    _on_a_connection(check)


def test_an_error_answer_keeps_its_status_and_body() -> None:
    body = b'{"error": {"message": "no such model"}}'
    answer = b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    def check(connection: _Connection, transport: _Transport) -> None:
        payloads, end = _feed(connection, answer, [10, len(answer) - 4])
        assert payloads == []
        assert end == StreamEnd(404, False, body) and connection.reusable

    _on_a_connection(check)


def test_a_server_that_says_close_is_not_reused() -> None:
    answer = HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + CHUNKED_200[len(HEAD) :]

    def check(connection: _Connection, transport: _Transport) -> None:
        _, end = _feed(connection, answer, [])
        assert end == StreamEnd(200, True, b"") and not connection.reusable

    _on_a_connection(check)


def test_an_answer_without_framing_ends_at_close() -> None:
    def check(connection: _Connection, transport: _Transport) -> None:
        payloads, end = _feed(connection, b"HTTP/1.1 200 OK\r\n\r\n" + SSE, [30], close=True)
        assert len(payloads) == len(EVENTS)
        assert end == StreamEnd(200, False, b"") and not connection.reusable

    _on_a_connection(check)


def test_a_connection_closed_mid_chunk_is_an_error() -> None:
    def check(connection: _Connection, transport: _Transport) -> None:
        _, end = _feed(connection, CHUNKED_200[:-20], [], close=True)
        assert isinstance(end, ConnectionError) and transport.closed

    _on_a_connection(check)


def test_a_malformed_chunk_is_an_error() -> None:
    def check(connection: _Connection, transport: _Transport) -> None:
        _, end = _feed(connection, HEAD + b"3\r\nabcXY0\r\n\r\n", [])
        assert isinstance(end, ValueError) and transport.closed

    _on_a_connection(check)


def test_only_plain_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="only http://"):
        SSEClient("https://127.0.0.1/v1/completions")


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    """A server that closes each connection after one answer, without saying so (as one does
    when its keep-alive timeout passes): every POST still gets its answer."""

    async def run() -> list[StreamEnd]:
        connections = 0

        async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.readuntil(b"\r\n\r\n{}")
            writer.write(CHUNKED_200)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()

        server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = SSEClient(f"http://127.0.0.1:{port}/v1/completions")
        ends = []
        for pause in (0.0, 0.2, 0.0):
            await asyncio.sleep(pause)
            payloads: list[bytes] = []
            ends.append(await client.post(b"{}", payloads.append))
            assert len(payloads) == len(EVENTS) + 1
        client.close()
        server.close()
        await server.wait_closed()
        assert connections == 3
        return ends

    assert asyncio.run(run()) == [StreamEnd(200, True, b"")] * 3


def test_a_load_against_the_server_counts_every_token(server: RunningServer) -> None:
    report = asyncio.run(
        run_load(
            base_url=server.url,
            num_requests=6,
            concurrency=3,
            input_len=16,
            output_len=8,
            timeout=120,
        )
    )
    assert report["errors"] == {}
    assert (report["completed"], report["failed"], report["length_mismatches"]) == (6, 0, 0)
    assert report["output_tokens"] == 6 * 8
    for row in report["requests"]:
        assert row["ok"] and row["output_tokens"] == 8
        assert 0 < row["ttft"] <= row["e2e"]
        assert math.isfinite(row["tpot"])


def test_a_load_the_server_refuses_reports_each_refusal(server: RunningServer) -> None:
    report = asyncio.run(
        run_load(
            base_url=server.url,
            model="no-such-model",
            num_requests=2,
            input_len=4,
            output_len=2,
            warmup=0,
            timeout=60,
        )
    )
    assert report["completed"] == 0 and report["failed"] == 2
    [(error, count)] = report["errors"].items()
    assert count == 2
    assert error.startswith("HTTP 404: ") and "no-such-model" in error
