"""Which addresses a URL-list download may connect to: no request forgery by a crawled list.

A URL list is input from the web, and a cluster node that fetches whatever it names can be made
to fetch its own cloud credentials (http://169.254.169.254/...), an internal service or a
loopback admin port into a dataset that is then shared. So every hop of every request (the
first URL and each redirect) is checked after DNS resolution, on the addresses the connection
will actually use: `GuardedResolver` sits under aiohttp's connector (names), `check_literal`
covers URLs that name an IP address (which aiohttp connects to without resolving). Refused:
every address that is not globally routable (loopback, RFC 1918 private, link-local with the
cloud metadata endpoints, carrier-grade NAT, reserved, multicast, IPv6 ULA), and every IPv6 address
that carries a refused IPv4 address (IPv4-mapped, -compatible and -translated, 6to4, NAT64's 64:ff9b::/96;
local-use NAT64, 64:ff9b:1::/48, whole), unless the user allows a named network
(`--allow-network 10.0.0.0/8`). The address a socket is about to connect to is checked again
(`guarded_socket`, aiohttp's socket factory), below the resolver and whatever resolved it.

Per process: the allowed networks (a handful) and aiohttp's DNS cache (one entry per host name).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from vitforge.core import UsageError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# IPv6 prefixes that carry an IPv4 address in their last 32 bits (Python's is_global passes them).
CARRY_IPV4_IN_LOW_BITS = (
    ipaddress.ip_network("64:ff9b::/96"),
    ipaddress.ip_network("::/96"),
    ipaddress.ip_network("::ffff:0:0:0/96"),
)  # NAT64, IPv4-compatible, IPv4-translated
LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: translates to any IPv4 address, local use


class ForbiddenAddress(Exception):
    """A URL (or one of its redirects) leads to an address downloads may not reach. Not an OSError,
    so aiohttp passes it through instead of reporting a DNS failure."""


def parse_networks(texts: Iterable[str]) -> tuple[Network, ...]:
    networks = []
    for text in texts:
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise UsageError(
                f"--allow-network {text!r} is not a network (examples: 127.0.0.0/8, 10.1.2.3, fd00::/8)"
            ) from None
    return tuple(networks)


def refusal(address: str, allowed: tuple[Network, ...]) -> str | None:
    """Why `address` may not be reached (None: it may)."""
    ip: Address = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id names no other host
    if any(ip in network for network in allowed):
        return None
    carried = _carried_ipv4(ip)
    if carried is not None:
        reason = refusal(str(carried), allowed)
        return reason and f"{ip} carries an IPv4 address: {reason}"
    if ip.is_global and not ip.is_multicast and ip not in LOCAL_NAT64:
        return None
    kind = (
        "loopback"
        if ip.is_loopback
        else "link-local (cloud metadata lives here)"
        if ip.is_link_local
        else "private"
        if ip.is_private
        else "multicast"
        if ip.is_multicast
        else "not globally routable"
    )
    return f"{ip} is {kind}; allow it with --allow-network if this list is trusted"


def _carried_ipv4(ip: Address) -> ipaddress.IPv4Address | None:
    if ip.version != 6:
        return None
    if ip.ipv4_mapped or ip.sixtofour:
        return ip.ipv4_mapped or ip.sixtofour
    if any(ip in prefix for prefix in CARRY_IPV4_IN_LOW_BITS) and int(ip) > 1:  # :: and ::1 are themselves
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def check_literal(host: str, allowed: tuple[Network, ...]) -> None:
    """A URL's host that is an IP address itself is checked here (no resolver sees it)."""
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return  # a name: the resolver checks what it resolves to
    reason = refusal(host.strip("[]"), allowed)
    if reason:
        raise ForbiddenAddress(reason)


def guarded_socket(allowed: tuple[Network, ...]):
    """aiohttp's `socket_factory`: a socket for an allowed address only, made before connecting."""

    def create(addr_info) -> socket.socket:
        family, kind, proto, _, address = addr_info
        reason = refusal(address[0], allowed)
        if reason:
            raise ForbiddenAddress(f"connecting to {reason}")
        return socket.socket(family=family, type=kind, proto=proto)

    return create


class GuardedResolver(AbstractResolver):
    """Resolves through `inner` (default: the system resolver in a thread) and refuses a name if
    any of its addresses is refused: connecting to the allowed ones only would still let a list
    steer traffic by choosing names that mix both."""

    def __init__(self, allowed: tuple[Network, ...], inner: AbstractResolver | None = None):
        self.allowed = allowed
        self.inner = inner or ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        answers = await self.inner.resolve(host, port, family)
        for answer in answers:
            reason = refusal(answer["host"], self.allowed)
            if reason:
                raise ForbiddenAddress(f"{host} resolves to {reason}")
        return answers

    async def close(self) -> None:
        await self.inner.close()
