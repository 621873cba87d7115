"""An ordered, bounded parallel map over worker processes (or threads).

Pool.imap queues every task and every finished result without limit, so a slow upload in the
main process lets decoded images pile up in memory; here at most `window` chunks are in flight.
Results come back in input order, which is what makes the output independent of worker count.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TypeVar

from vitforge.core.process import die_with_parent

T = TypeVar("T")
R = TypeVar("R")


def _run_chunk(fn, chunk):
    return [fn(item) for item in chunk]


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    workers: int,
    chunk_size: int = 8,
    window_per_worker: int = 4,
    threads: bool = False,
) -> Generator[R, None, None]:
    """`threads=True` suits work that releases the GIL (file reads, hashing)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    executor: Executor
    if threads:
        executor = ThreadPoolExecutor(workers)
    else:
        # fork starts workers without re-importing anything (spawn costs ~0.3 s of CPU per worker);
        # object_store's clients are forgotten in forked children. A fork pool forks every worker at
        # its first submit: done here, before `items` is first read, since reading it may start
        # threads (the URL downloader's event loop) whose half-held locks a fork would copy.
        executor = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=die_with_parent,
            initargs=(os.getpid(),),
        )
    with executor as pool:
        if not threads:
            pool.submit(int).result()
        pending: deque = deque()
        chunk: list = []

        def submit(c):
            pending.append(pool.submit(_run_chunk, fn, c))

        for item in items:
            chunk.append(item)
            if len(chunk) == chunk_size:
                submit(chunk)
                chunk = []
                while len(pending) >= workers * window_per_worker:
                    yield from pending.popleft().result()
        if chunk:
            submit(chunk)
        while pending:
            yield from pending.popleft().result()
