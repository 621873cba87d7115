"""One item ahead: what lets a loader's work on the next batch overlap the step, in a thread
(decode, receive) or on a CUDA side stream (host-to-device copy)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
B = TypeVar("B", bound=Mapping[str, object])  # a batch: a dict of tensors (pipeline's Batch)


def read_ahead(items: Iterator[T]) -> Generator[T, None, None]:
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


def copy_ahead(
    batches: Iterator[B], move: Callable[[B], B], stream: torch.cuda.Stream | None = None
) -> Generator[B, None, None]:
    """Each batch moved (`move`: host-to-device copy from pinned memory, normalisation) one batch
    ahead of the consumer. With a CUDA `stream`, the moves run on it, so batch i+1's copy overlaps
    the consumer's kernels for batch i; before the consumer gets a batch, its stream waits for the
    move, and the batch's tensors are marked as used there (the allocator must not reuse them early)."""
    pending = None
    for batch in batches:
        if stream is None:
            moved = move(batch)
        else:
            with torch.cuda.stream(stream):
                moved = move(batch)
        if pending is not None:
            yield _ready(pending, stream)
        pending = moved
    if pending is not None:
        yield _ready(pending, stream)


def _ready(batch: B, stream: torch.cuda.Stream | None) -> B:
    if stream is not None:
        consumer = torch.cuda.current_stream(stream.device)
        consumer.wait_stream(stream)
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(consumer)
    return batch
