"""Which hosts and addresses an image URL may reach. A name is resolved here, once, and the
fetch connects to the address that was checked: a DNS answer that changes between the check
and the connect (rebinding) cannot move the fetch onto a private address."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from config.media_config import MediaPolicy
from server.media.errors import refused

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def named_host(host: str) -> str:
    """A URL's host as --allowed-media-domains names it: lower case, no brackets or final dot."""
    return host.strip("[]").rstrip(".").lower()


def allowed_by_name(host: str, policy: MediaPolicy) -> bool:
    return policy.allowed_domains is not None and named_host(host) in policy.allowed_domains


def check_host(host: str, policy: MediaPolicy, where: str) -> None:
    """Refuse a host that --allowed-media-domains does not name, when it names any."""
    if policy.allowed_domains is not None and not allowed_by_name(host, policy):
        raise refused(where, f"image URL host {host!r} is not in --allowed-media-domains")


def non_public(address: IPAddress) -> str | None:
    """Why a fetch may not reach `address` unless its host is allowed by name; None: public."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1 on the wire
    for kind, flagged in (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("non-public", not address.is_global),
    ):
        if flagged:
            return f"a {kind} address"
    return None


async def resolve_checked(host: str, port: int, policy: MediaPolicy, where: str) -> list[str]:
    """The addresses to connect to for `host`, in order. Every address the name has must be
    public, unless the host is allowed by name (an internal image store the operator vouches
    for)."""
    name = named_host(host)
    literal = True
    try:
        addresses: list[IPAddress] = [ipaddress.ip_address(name)]
    except ValueError:
        literal = False
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, port, type=socket.SOCK_STREAM
            )
        except (socket.gaierror, UnicodeError) as exc:
            raise refused(where, f"cannot resolve image URL host {host!r} ({exc})") from None
        # (the scope of a link-local IPv6 address, fe80::1%eth0, is not part of the address)
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise refused(where, f"image URL host {host!r} has no address")
    if not allowed_by_name(host, policy):
        for address in addresses:
            reason = non_public(address)
            if reason is not None:
                what = f"is {reason}" if literal else f"resolves to {reason}"
                raise refused(
                    where,
                    f"image URL host {host!r} {what}, refused unless --allowed-media-domains "
                    "names it",
                )
    return list(dict.fromkeys(str(address) for address in addresses))
