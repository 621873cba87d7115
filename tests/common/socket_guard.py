"""A socket guard for tests that must prove no packet leaves for a refused address: while active,
every `connect` this process makes is recorded, and one to an address outside loopback fails
the connect (and the test) before anything is sent. Built on an audit hook (PEP 578), which sees
every socket.connect, asyncio's non-blocking ones included; hooks cannot be removed, so one hook
serves every use and does nothing while no guard is active."""

from __future__ import annotations

import contextlib
import ipaddress
import sys

_active: list[list] = []  # the connect log of each active guard


def _hook(event: str, args: tuple) -> None:
    if not _active or event != "socket.connect":
        return
    address = args[1]
    if not isinstance(address, tuple):
        return  # a Unix socket
    host = str(address[0]).split("%", 1)[0]
    _active[-1].append(host)
    if not ipaddress.ip_address(host).is_loopback:
        raise PermissionError(f"socket guard: a connect to {host} was attempted (only loopback is allowed)")


sys.addaudithook(_hook)


@contextlib.contextmanager
def loopback_only():
    """Yields the list of addresses connected to while active (a refused one is listed too)."""
    log: list = []
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)
