"""A tiny HTTP server on 127.0.0.1 that misbehaves on request: it serves a PNG, stalls,
sends too much (with and without a Content-Length), redirects, and fails before it answers."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from PIL import Image

STALL_LIMIT_S = 10.0  # a stalled answer is released at teardown, or after this at worst


def png_bytes(size: tuple[int, int] = (8, 6), color: tuple[int, ...] = (200, 30, 40)) -> bytes:
    mode = "RGBA" if len(color) == 4 else "RGB"
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()


@dataclass
class Seen:
    """What the server was asked: paths and Host headers, in order; failures still owed."""

    requests: list[tuple[str, str]] = field(default_factory=list)
    failures_left: dict[str, int] = field(default_factory=dict)
    released: threading.Event = field(default_factory=threading.Event)


def _handler(seen: Seen) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet test output
            pass

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            seen.requests.append((url.path, self.headers.get("Host", "")))
            route = getattr(self, "route_" + url.path.strip("/").replace("-", "_"), None)
            if route is None:
                self.answer(404, b"no such image")
            else:
                route(query)

        def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def route_png(self, query: dict[str, str]) -> None:
            self.answer(200, PNG, {"Content-Type": "image/png"})

        def route_text(self, query: dict[str, str]) -> None:
            self.answer(200, b"<html>not an image</html>", {"Content-Type": "text/html"})

        def route_stall(self, query: dict[str, str]) -> None:
            seen.released.wait(STALL_LIMIT_S)  # never answers while the test runs

        def route_huge_length(self, query: dict[str, str]) -> None:
            # Says it is 1 GiB, then sends nothing: only the header can refuse it in time.
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            self.wfile.flush()
            seen.released.wait(STALL_LIMIT_S)

        def route_endless(self, query: dict[str, str]) -> None:
            # No Content-Length, a body that never ends: only counting as it streams stops it.
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            chunk = b"\0" * 65536
            deadline = time.monotonic() + STALL_LIMIT_S
            try:
                while not seen.released.is_set() and time.monotonic() < deadline:
                    self.wfile.write(chunk)
            except OSError:  # the client hung up once it had enough
                pass
            self.close_connection = True

        def route_chunked(self, query: dict[str, str]) -> None:
            # A short Content-Length would cut the body; chunks have none to check up front.
            size = int(query["bytes"])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent = 0
            try:
                while sent < size:
                    part = min(65536, size - sent)
                    self.wfile.write(f"{part:x}\r\n".encode() + b"\0" * part + b"\r\n")
                    sent += part
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
            self.close_connection = True

        def route_redirect(self, query: dict[str, str]) -> None:
            self.answer(302, b"", {"Location": query["to"]})

        def route_loop(self, query: dict[str, str]) -> None:
            self.answer(302, b"", {"Location": "/loop"})

        def route_hops(self, query: dict[str, str]) -> None:
            left = int(query["n"])
            self.answer(302, b"", {"Location": f"/hops?n={left - 1}" if left > 1 else "/png"})

        def route_flaky(self, query: dict[str, str]) -> None:
            # Fails the first `n` times it is asked under a key, then serves the PNG.
            key = query["key"]
            left = seen.failures_left.setdefault(key, int(query["n"]))
            if left > 0:
                seen.failures_left[key] = left - 1
                self.answer(503, b"busy")
            else:
                self.route_png(query)

    return Handler


@dataclass
class ImageServer:
    port: int
    seen: Seen

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextmanager
def image_server() -> Iterator[ImageServer]:
    seen = Seen()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(seen))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="test-image-server", daemon=True)
    thread.start()
    try:
        yield ImageServer(httpd.server_address[1], seen)
    finally:
        seen.released.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
