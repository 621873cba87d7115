"""Processes that must not outlive the one that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies. A worker or rank orphaned by a
    `kill -9` of its launcher would otherwise run on, holding memory, a lease or a GPU."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
