"""Image URLs over HTTP against a local server that misbehaves: the fetch reaches only what the
policy allows, stops at its byte cap and deadline, re-checks every redirect, and never holds
up the event loop."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from config.media_config import MediaPolicy
from server.media import MediaError, load_image
from tests.server.media.image_server import ImageServer, image_server

WHERE = "messages.0.content.1"
LOCAL = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=2.0, max_retries=0)


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with image_server() as running:
        yield running


def load(url: str, policy: MediaPolicy = LOCAL) -> Any:
    return asyncio.run(load_image(url, policy, WHERE))


def refusal(url: str, policy: MediaPolicy = LOCAL) -> MediaError:
    with pytest.raises(MediaError) as info:
        load(url, policy)
    assert info.value.param == WHERE and info.value.status == 400
    assert info.value.message.startswith(f"{WHERE}: ")
    return info.value


def test_png_from_a_host_allowed_by_name(server: ImageServer) -> None:
    image = load(server.url("/png"))
    assert image.mode == "RGB" and image.size == (8, 6)
    assert image.getpixel((3, 2)) == (200, 30, 40)


def test_localhost_allowed_by_name_is_reached_on_its_ipv4_address(server: ImageServer) -> None:
    # localhost may resolve to ::1 first; the server listens on 127.0.0.1 only.
    policy = MediaPolicy(allowed_domains=frozenset({"localhost"}), timeout_s=2.0)
    assert load(server.url("/png", host="localhost"), policy).size == (8, 6)


def test_the_checked_address_is_the_one_connected_to(
    server: ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name resolved once: a later answer (DNS rebinding) cannot move the connection, and the
    server still sees the name in the Host header."""
    asked: list[str] = []
    real = asyncio.BaseEventLoop.getaddrinfo

    async def rebinding(self: Any, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "images.test":
            return await real(self, host, port, *args, **kwargs)
        asked.append(host)
        # First answer: the server; any later one: an address where nothing listens.
        address = "127.0.0.1" if len(asked) == 1 else "127.0.0.2"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", rebinding)
    policy = MediaPolicy(allowed_domains=frozenset({"images.test"}), timeout_s=2.0)
    before = len(server.seen.requests)
    assert load(server.url("/png", host="images.test"), policy).size == (8, 6)
    assert asked == ["images.test"]
    assert server.seen.requests[before:] == [("/png", f"images.test:{server.port}")]


@pytest.mark.parametrize(
    ("host", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.7", "private"),
        ("169.254.169.254", "link-local"),
        ("[::1]", "loopback"),
        ("[fe80::1]", "link-local"),
        ("[::ffff:127.0.0.1]", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),
    ],
)
def test_non_public_addresses_refused_unless_named(host: str, kind: str) -> None:
    # Refused before any connection is tried: none of these is ever contacted.
    error = refusal(f"http://{host}:9/image.png", MediaPolicy(timeout_s=1.0))
    assert f"is a {kind} address" in error.message
    assert "--allowed-media-domains" in error.message


def test_a_name_resolving_to_loopback_is_refused(server: ImageServer) -> None:
    before = len(server.seen.requests)
    error = refusal(server.url("/png", host="localhost"), MediaPolicy(timeout_s=2.0))
    assert "'localhost' resolves to a loopback address" in error.message
    assert len(server.seen.requests) == before  # refused before it connected


def test_hosts_outside_the_allowed_domains_are_refused(server: ImageServer) -> None:
    policy = MediaPolicy(allowed_domains=frozenset({"images.example.com"}), timeout_s=1.0)
    assert "not in --allowed-media-domains" in refusal(server.url("/png"), policy).message


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/a.png", "gopher://127.0.0.1/", "ws://x/a"])
def test_other_schemes_are_refused(url: str) -> None:
    assert "must be a data:, http(s):// or file:// URL" in refusal(url).message


def test_a_stalled_server_fails_within_the_timeout(server: ImageServer) -> None:
    policy = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=0.5)
    started = time.monotonic()
    error = refusal(server.url("/stall"), policy)
    assert time.monotonic() - started < 2.0
    assert "took longer than 0.5 s" in error.message


def test_a_stalled_fetch_leaves_the_event_loop_running(server: ImageServer) -> None:
    policy = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=0.6)

    async def main() -> tuple[int, BaseException | None]:
        ticks = 0
        fetch = asyncio.create_task(load_image(server.url("/stall"), policy, WHERE))
        while not fetch.done():
            await asyncio.sleep(0.05)
            ticks += 1
        return ticks, fetch.exception()

    ticks, error = asyncio.run(main())
    assert isinstance(error, MediaError)
    assert ticks >= 8  # 0.6 s of 0.05 s sleeps, less scheduling slack on a loaded machine


def test_a_content_length_over_the_cap_is_refused_up_front(server: ImageServer) -> None:
    started = time.monotonic()
    error = refusal(server.url("/huge-length"))  # the body never comes: the header decides
    assert time.monotonic() - started < 1.5
    assert "larger than 20971520 bytes" in error.message


def test_a_body_without_length_is_cut_at_the_cap(server: ImageServer) -> None:
    policy = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=5.0, max_bytes=300_000)
    started = time.monotonic()
    error = refusal(server.url("/endless"), policy)
    assert time.monotonic() - started < 3.0  # stopped by the cap, not the deadline
    assert "larger than 300000 bytes" in error.message
    over = server.url("/chunked?bytes=300001")
    assert "larger than 300000 bytes" in refusal(over, policy).message
    # Exactly the cap passes the fetch (and fails decoding: zeros are no image).
    assert "not an image" in refusal(server.url("/chunked?bytes=300000"), policy).message


def test_redirects_are_followed_up_to_five(server: ImageServer) -> None:
    assert load(server.url("/hops?n=5")).size == (8, 6)
    assert "more than 5 times" in refusal(server.url("/hops?n=6")).message
    assert "more than 5 times" in refusal(server.url("/loop")).message


def test_every_redirect_is_checked_again(server: ImageServer) -> None:
    by_name = MediaPolicy(allowed_domains=frozenset({"localhost"}), timeout_s=2.0)
    to_address = server.url("/redirect?to=" + server.url("/png"), host="localhost")
    assert "'127.0.0.1' is not in --allowed-media-domains" in refusal(to_address, by_name).message
    to_file = server.url("/redirect?to=file:///etc/passwd")
    assert "is not http(s)" in refusal(to_file).message
    to_metadata = server.url("/redirect?to=http://169.254.169.254/latest/meta-data")
    assert "not in --allowed-media-domains" in refusal(to_metadata).message


def test_a_relative_redirect_stays_on_the_checked_host(server: ImageServer) -> None:
    assert load(server.url("/redirect?to=/png")).size == (8, 6)


def test_5xx_answers_are_retried_and_others_are_not(server: ImageServer) -> None:
    retrying = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=3.0, max_retries=2)
    assert load(server.url("/flaky?key=a&n=2"), retrying).size == (8, 6)
    assert "answered 503" in refusal(server.url("/flaky?key=b&n=3"), retrying).message
    before = len(server.seen.requests)
    assert "answered 404" in refusal(server.url("/missing"), retrying).message
    assert len(server.seen.requests) == before + 1


def test_a_refused_connection_is_a_400_within_the_deadline() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    policy = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=2.0, max_retries=1)
    error = refusal(f"http://127.0.0.1:{port}/a.png", policy)
    assert "cannot connect" in error.message


def test_text_served_as_an_image_is_refused(server: ImageServer) -> None:
    assert "not an image" in refusal(server.url("/text")).message
