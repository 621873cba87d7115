"""Stopping early, cleanly: SIGUSR1 / SIGTERM (what SLURM sends before preempting or at
`--signal`), and a wall-clock budget. The handler only records the request; ranks agree on it at
the next step boundary, so no rank saves alone, and a second signal during the save changes nothing.
`vitforge train` holds (blocks) these signals from its first line; `listen` releases them once
start-up is over, so one that came meanwhile stops the run after its first step.
"""

from __future__ import annotations

import signal
import threading
import time

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    def __init__(self, max_minutes: float | None):
        self.signal: int | None = None
        self.deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def listen(self) -> None:
        """Deliver stop signals from now on, including one held during start-up."""
        if threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def held(self) -> str | None:
        """The stop signal received or still held (blocked and pending), if any."""
        pending = signal.sigpending() & set(STOP_SIGNALS)
        signum = self.signal or min(pending, default=None)
        return f"signal {signal.Signals(signum).name}" if signum else None

    def reason(self) -> str | None:
        """Why this rank wants to stop, or None."""
        if self.signal is not None:
            return f"signal {signal.Signals(self.signal).name}"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "train.max_minutes reached"
        return None

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
