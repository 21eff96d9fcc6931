"""An image URL's bytes over http(s), safe to fetch for an untrusted client: only hosts the
policy allows, connected to by the address that was checked (the name still goes in the Host
header and TLS SNI, and the certificate is verified against it), redirects followed by hand
and each hop checked again, the body capped as it streams, and one deadline for it all."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from config.media_config import MediaPolicy
from server.media.errors import refused
from server.media.policy import check_host, resolve_checked

RETRY_BACKOFF_S = 0.1  # doubled at each retry; all within the fetch's deadline
_REDIRECTS = {301, 302, 303, 307, 308}


@dataclass
class _Redirect:
    location: str


class _Retryable(Exception):
    """A failure a later attempt may not meet: no connection, or a 5xx answer."""


class _Unreachable(_Retryable):
    """No connection to one address: the host's next one may answer."""


def shown(url: str | httpx.URL) -> str:
    text = str(url)
    return text if len(text) <= 120 else text[:117] + "..."


async def fetch_url(url: str, policy: MediaPolicy, where: str) -> bytes:
    try:
        return await asyncio.wait_for(_follow(url, policy, where), policy.timeout_s)
    except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
        raise refused(
            where,
            f"fetching {shown(url)} took longer than {policy.timeout_s:g} s "
            "(--media-fetch-timeout)",
        ) from None


async def _follow(url: str, policy: MediaPolicy, where: str) -> bytes:
    # trust_env=False: a proxy from the environment would resolve the name itself, past the
    # address check. One client per fetch: a pooled connection to an address must not carry
    # another host's request.
    timeout = httpx.Timeout(policy.timeout_s)
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, timeout=timeout
    ) as client:
        for _hop in range(policy.max_redirects + 1):
            got = await _get_with_retries(client, url, policy, where)
            if isinstance(got, bytes):
                return got
            url = got.location
    raise refused(where, f"image URL redirected more than {policy.max_redirects} times")


async def _get_with_retries(
    client: httpx.AsyncClient, url: str, policy: MediaPolicy, where: str
) -> bytes | _Redirect:
    for attempt in range(policy.max_retries + 1):
        try:
            return await _get(client, url, policy, where)
        except _Retryable as exc:
            if attempt == policy.max_retries:
                raise refused(where, f"fetching {shown(url)} failed: {exc}") from None
            await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


async def _get(
    client: httpx.AsyncClient, url: str, policy: MediaPolicy, where: str
) -> bytes | _Redirect:
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise refused(where, f"invalid image URL {shown(url)} ({exc})") from None
    if target.scheme not in ("http", "https") or not target.host:
        raise refused(where, f"image URL {shown(url)} is not http(s)")
    check_host(target.host, policy, where)
    port = target.port or (443 if target.scheme == "https" else 80)
    addresses = await resolve_checked(target.host, port, policy, where)
    for address in addresses[:-1]:  # (localhost: ::1, then 127.0.0.1)
        try:
            return await _get_from(client, target, address, policy, where)
        except _Unreachable:
            continue
    return await _get_from(client, target, addresses[-1], policy, where)


async def _get_from(
    client: httpx.AsyncClient, target: httpx.URL, address: str, policy: MediaPolicy, where: str
) -> bytes | _Redirect:
    pinned = target.copy_with(host=address)
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    # identity: a compressed body would be inflated past the byte cap before it is counted.
    headers = {"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity"}
    try:
        async with client.stream("GET", pinned, headers=headers, extensions=extensions) as answer:
            if answer.status_code in _REDIRECTS and "location" in answer.headers:
                return _Redirect(str(target.join(answer.headers["location"])))
            if answer.status_code >= 500:
                raise _Retryable(f"the server answered {answer.status_code}")
            if answer.status_code != 200:
                raise refused(
                    where, f"fetching {shown(target)}: the server answered {answer.status_code}"
                )
            return await _body(answer, policy, where)
    except httpx.TimeoutException:
        raise refused(
            where, f"fetching {shown(target)} took longer than {policy.timeout_s:g} s"
        ) from None
    except httpx.ConnectError as exc:
        raise _Unreachable(f"cannot connect ({exc})") from None
    except httpx.TransportError as exc:
        raise _Retryable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None


async def _body(answer: httpx.Response, policy: MediaPolicy, where: str) -> bytes:
    too_big = f"image is larger than {policy.max_bytes} bytes (--max-media-download-size-mb)"
    declared = answer.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise refused(where, too_big)
    body = bytearray()
    async for chunk in answer.aiter_raw():
        body += chunk
        if len(body) > policy.max_bytes:
            raise refused(where, too_big)
    return bytes(body)
