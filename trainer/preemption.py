"""Stopping early, cleanly: SIGUSR1 / SIGTERM (what SLURM sends before preempting or at
`--signal`), and a wall-clock budget. The handler only records the request; ranks agree on it at
the next step boundary, so no rank saves alone, and a second signal during the save changes nothing.
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
