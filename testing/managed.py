"""How every stand-in server runs: a process in a session of its own (so that stopping it ends the
children it starts, node's or uvicorn's), its output appended to a log file, waited for until it
answers, and stopped as a whole process group. The stand-ins differ only in their command, their
readiness probe and what they hand to a client."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


def start_process(cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    """`cmd` in its own session, stdout and stderr appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_process(process: subprocess.Popen, kill: bool = False, grace_s: float = 10) -> None:
    """End the process's whole group: SIGTERM (SIGKILL with `kill`: a crash, nothing flushed), then
    SIGKILL if it has not ended within `grace_s`."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:  # ended between the poll and the signal
        process.wait()


def log_tail(log_path: str, chars: int = 2000) -> str:
    with open(log_path, errors="replace") as f:
        return f.read()[-chars:]


def wait_until_ready(
    process: subprocess.Popen, ready: Callable[[], bool], what: str, log_path: str, timeout: float, poll_s: float = 0.1
) -> None:
    """Poll `ready()` (False or an OSError: not yet) until it is True. A RuntimeError naming `what`
    and the log's tail when the process exits first or `timeout` passes (the process stopped then)."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {log_tail(log_path)}")
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_process(process, kill=True)
            raise RuntimeError(f"{what} did not answer within {timeout:g} s (log {log_path}): {log_tail(log_path)}")
        time.sleep(poll_s)
