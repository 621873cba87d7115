"""Reading a shard straight from its store, when the node's cache has no room for it (or its disk is
full): coalesced ranged GETs, fetched ahead of need.

The reader tells the shard which of its samples come next, in read order (`expect`). Up to
AHEAD_BYTES of them are requested ahead: taken in read order, sorted by offset, and samples whose
gap is at most MERGE_GAP bytes joined into one GET of at most REQUEST_BYTES that is at least half
samples (a sequential reader's samples all join: one request per 8 MiB instead of one per sample;
a shuffled epoch's join where they lie close, which half a shard's worth ahead makes common), at
most IN_FLIGHT GETs at a time. A read nobody announced is one GET, as before. A store's cost is
per request as much as per byte (the S3 server's CPU on a small node, a cloud's request rate and
latency): fetching a gap of up to 1 MiB along costs less than a request of its own.
benchmarks/loader_bench.py --s3 measures it against cached reads.

Per reader and streamed shard: IN_FLIGHT threads, at most 2 x AHEAD_BYTES plus one request's
bytes held (a request's gaps are never more than its samples, and are held with it until its last
sample is read), and the announced (offset, length) pairs of that shard: two integers per sample
still to read, at most a shard's samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from vitforge.core import Store

AHEAD_BYTES = 32 << 20
MERGE_GAP = 1 << 20
REQUEST_BYTES = 8 << 20
IN_FLIGHT = 8


class StreamedShard:
    """A shard the node's disk cannot hold, read from the store by offset."""

    def __init__(self, store: Store, key: str, counted: Callable[[int], None]):
        self.store, self.key, self.counted = store, key, counted
        self._announced: deque[tuple[int, int]] = deque()  # (offset, length) not yet requested, in read order
        self._requested: dict[tuple[int, int], deque[tuple[Future, int]]] = {}  # -> (its request, start in it)
        self._held = 0  # bytes of requested samples not yet read
        self._pool: ThreadPoolExecutor | None = None

    def expect(self, ranges: list[tuple[int, int]]) -> None:
        """The (offset, length) of the samples this reader will read next, in read order."""
        self._announced.extend(ranges)

    def pread(self, length: int, offset: int) -> bytes:
        self._request_ahead()
        waiting = self._requested.get((offset, length))
        if not waiting:
            return self._get(offset, offset + length)
        future, start = waiting.popleft()
        if not waiting:
            del self._requested[(offset, length)]
        self._held -= length
        data = future.result()
        self._request_ahead()
        return data[start : start + length]

    def _request_ahead(self) -> None:
        taken: list[tuple[int, int]] = []
        while self._announced and self._held < AHEAD_BYTES:
            taken.append(self._announced.popleft())
            self._held += taken[-1][1]
        if not taken:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="shard-stream")
        for first, last, members in _coalesce(taken):
            future = self._pool.submit(self._get, first, last)
            for offset, length in members:
                self._requested.setdefault((offset, length), deque()).append((future, offset - first))

    def _get(self, start: int, end: int) -> bytes:
        data = self.store.get_range(self.key, start, end)
        self.counted(len(data))
        return data

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._announced.clear()
        self._requested.clear()


def _coalesce(samples: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, end, members) requests covering `samples` (offset, length): sorted by offset,
    neighbours at most MERGE_GAP apart joined while a request stays within REQUEST_BYTES and at
    least half of it is samples (so the gaps fetched along never exceed the samples' bytes)."""
    requests: list[tuple[int, int, list[tuple[int, int]]]] = []
    useful = 0  # bytes of samples in the last request
    for offset, length in sorted(samples):
        if requests:
            start, end, members = requests[-1]
            span = max(end, offset + length) - start
            if offset - end <= MERGE_GAP and span <= REQUEST_BYTES and span <= 2 * (useful + length):
                members.append((offset, length))
                requests[-1] = (start, max(end, offset + length), members)
                useful += length
                continue
        requests.append((offset, offset + length, [(offset, length)]))
        useful = length
    return requests
