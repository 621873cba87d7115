"""Ports on this host."""

from __future__ import annotations

import random
import socket

from .scheduler import SLURM_PORT_BASE

LOWEST = 10000  # below: the registered ports of common services
TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing is bound to now, for a server about to start on it (a
    rendezvous store, a test's stand-in server). Picked at random below the kernel's ephemeral
    range: bind(0) hands out a port inside that range, where any process's outgoing connection may
    take it before the server binds it (EADDRINUSE: seen with tests in parallel); below it only
    another explicit bind can. Below the SLURM jobs' rendezvous ports too (SLURM_PORT_BASE up),
    which a job binds from its id without asking: a server here must not hold a job's port before
    the job starts. Random from the OS, not the `random` module, so that processes seeded alike
    do not pick alike."""
    pick = random.SystemRandom()
    highest = min(_ephemeral_start(), SLURM_PORT_BASE) - 1
    for _ in range(TRIES if highest > LOWEST else 0):
        with socket.socket() as s:
            try:
                s.bind((host, pick.randint(LOWEST, highest)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # nothing free below the range: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems start higher (49152)
