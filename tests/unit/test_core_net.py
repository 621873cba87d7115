"""Ports for the servers a job starts (core/net.py)."""

from __future__ import annotations

import socket

from vitforge.core import free_port
from vitforge.core.scheduler import SLURM_PORT_BASE


def test_a_free_port_is_below_the_ephemeral_range_and_the_slurm_jobs_ports():
    # A server's port must be neither one an outgoing connection may take (the ephemeral range) nor
    # one a SLURM job on this host binds from its id without asking (SLURM_PORT_BASE up).
    ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(200)}
    assert all(10000 <= port < min(ephemeral, SLURM_PORT_BASE) for port in ports), sorted(ports)
    assert len(ports) > 150  # at random, not one port handed to every test worker
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free when handed out
