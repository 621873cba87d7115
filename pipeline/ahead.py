"""One item ahead, in a thread: what lets a loader's work on the next batch overlap the step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator


def read_ahead(items: Iterator) -> Iterator:
    """The same items, each produced in one thread while the previous one is consumed; closing
    this closes `items` too (in the consumer's thread, once the producing thread is idle)."""
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as ahead:
            pending = ahead.submit(next, items, None)
            while (item := pending.result()) is not None:
                pending = ahead.submit(next, items, None)
                yield item
    finally:
        getattr(items, "close", lambda: None)()
