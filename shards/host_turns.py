"""Taking turns at a host: at most `per_host` requests to one origin at once, their starts at least
1 / `rate` seconds apart (0: no rate limit).

The waits happen here, before a request's clocks run (`waiting` pauses them): how long a row waits
for its turn depends on the other rows in flight, and which rows time out must not.

Per process: one slot entry per origin with a request holding or awaiting a turn (dropped with its
last user), and rate clocks, pruned to those whose next start is still ahead whenever they
outnumber max(64, twice what the last pruning kept): both grow with the downloads in flight, never
with the number of hosts a list names.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field


@dataclass
class _Slots:
    free: asyncio.Semaphore
    users: int = 0


@dataclass
class HostTurns:
    per_host: int
    rate: float = 0.0
    _slots: dict[str, _Slots] = field(default_factory=dict)
    _next_start: dict[str, float] = field(default_factory=dict)
    _prune_above: int = 64

    @contextlib.asynccontextmanager
    async def turn(self, origin: str, waiting):
        """Holds one of `origin`'s slots for the block, entered once the rate limit allows.
        `waiting()`: a context manager around each wait (the caller's deadline pauses in it)."""
        slots = self._slots.get(origin)
        if slots is None:
            slots = self._slots[origin] = _Slots(asyncio.Semaphore(self.per_host))
        slots.users += 1
        try:
            async with waiting():
                await slots.free.acquire()
            try:
                if self.rate:
                    async with waiting():
                        await asyncio.sleep(self._reserve_start(origin))
                yield
            finally:
                slots.free.release()
        finally:
            slots.users -= 1
            if not slots.users:
                del self._slots[origin]

    def _reserve_start(self, origin: str) -> float:
        """Seconds until this request may start; the origin's next start moves on by 1 / rate."""
        now = time.monotonic()
        start = max(now, self._next_start.get(origin, now))
        self._next_start[origin] = start + 1.0 / self.rate
        if len(self._next_start) > self._prune_above:  # a start in the past constrains nothing
            self._next_start = {o: t for o, t in self._next_start.items() if t > now}
            self._prune_above = max(64, 2 * len(self._next_start))
        return start - now
