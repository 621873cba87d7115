"""Progress for long runs: a tqdm bar on a terminal, a plain log line every few seconds otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter

log = logging.getLogger("vitforge.progress")


class Progress:
    def __init__(self, total: int, what: str, interval: float = 10.0):
        self.total, self.what, self.interval = total, what, interval
        self.done = 0
        self.bytes = 0
        self.outcomes: Counter = Counter()  # failures by reason; the rest of `done` succeeded
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

    def count(self, outcome: str) -> None:
        """One more input ended as `outcome` (a reject reason): shown beside the rate."""
        self.outcomes[outcome] += 1
        if self.bar is not None:
            self.bar.set_postfix_str(self._outcomes(), refresh=False)

    def _outcomes(self) -> str:
        failed = ", ".join(f"{reason} {n}" for reason, n in self.outcomes.most_common(4))
        more = len(self.outcomes) - 4
        return (
            f"ok {max(0, self.done - sum(self.outcomes.values()))}"
            + (f", {failed}" if failed else "")
            + (f", {more} more reasons" if more > 0 else "")
        )

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("inf")
        share = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"{self.what}: {self.done}/{self.total} images ({share:.1f}%), {rate:.0f} img/s, "
            f"{self.bytes / elapsed / 1e6:.1f} MB/s, ETA {_clock(eta)}"
            + (f"; {self._outcomes()}" if self.outcomes else "")
        )

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
