"""Progress for long runs: a tqdm bar on a terminal, a plain log line every few seconds otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("vitforge.progress")


class Progress:
    def __init__(self, total: int, what: str, interval: float = 10.0):
        self.total, self.what, self.interval = total, what, interval
        self.done = 0
        self.bytes = 0
        self.start = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty() and total:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", desc=what, dynamic_ncols=True, smoothing=0.1)

    def update(self, images: int, nbytes: int = 0) -> None:
        self.done += images
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(images)
            return
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            log.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("inf")
        share = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.what}: {self.done}/{self.total} images ({share:.1f}%), {rate:.0f} img/s, "
                f"{self.bytes / elapsed / 1e6:.1f} MB/s, ETA {_clock(eta)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done:
            log.info("%s", self.line())


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
