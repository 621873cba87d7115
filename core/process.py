"""Processes that must not outlive the one that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from .logs import process_rank

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies. A worker or rank orphaned by a
    `kill -9` of its launcher would otherwise run on, holding memory, a lease or a GPU."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def record_exit_code(code: int, claim: bool = False) -> bool:
    """A job of many tasks is reported by srun as a whole (with --kill-on-bad-exit, a rank still
    shutting down is killed and srun says 143): rank 0's own verdict goes to VITFORGE_EXIT_FILE
    when it is set (by the CLI on its way out, and by the trainer's hang watchdog, which ends the
    process itself), over whatever is there. `claim`: any rank's verdict, written only where none
    is there yet (the file is created exclusively): the hang watchdog's when rank 0 is the one stuck
    and can record none; the first claim stands, and rank 0's own verdict still overwrites it.
    True when written."""
    verdict = os.environ.get("VITFORGE_EXIT_FILE")
    if not verdict or not (claim or process_rank() == 0):
        return False
    try:
        fd = os.open(verdict, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if claim else os.O_TRUNC), 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{code}\n")
    return True
