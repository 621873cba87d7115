"""Work that one task of a job array does and the others wait for: the shard plan, and each unit of
a plan made across the array (a share of the listing, a bucket of the sort).

A unit is done once its result object exists; results are written whole and are the same bytes
whoever makes them, so a unit made twice (a task thought dead that was only slow) costs time,
never correctness. Who makes a unit is decided by its claim object: the first task to create it
(a create-only write: S3 If-None-Match, a lock file locally) makes the unit, renewing the claim
while it works; a claim whose writer died (its pid gone on this host, or no renewal for
CLAIM_STALE_S by the waiting task's own clock) is taken over, so a crashed task delays the job,
never blocks it. A claim is deleted once its result exists, or when making it failed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from vitforge.core import PreconditionFailed, StorageError, UsageError, process_alive

log = logging.getLogger("vitforge.shard")

CLAIM_STALE_S = 300.0  # a claim not renewed for this long is taken over
POLL_S = 5.0

T = TypeVar("T")


def made_once(
    store,
    claim: str,
    ready: Callable[[], T | None],
    make: Callable[[], T],
    part: int,
    what: str,
    wait_s: float,
    block: bool = True,
) -> T | None:
    """`ready()`'s result once it is not None: made here by `make()` if this task wins the claim,
    else waited for (up to `wait_s`, then an error naming the task that holds the claim). With
    `block=False`, None at once when another live task holds the claim."""
    deadline = time.monotonic() + wait_s
    seen: tuple[str | None, float] | None = None  # (claim version, when this task first saw it)
    while True:
        result = ready()
        if result is not None:
            return result
        held = store.get_versioned(claim)
        version = held[1] if held else None
        if seen is None or seen[0] != version:
            seen = (version, time.monotonic())
        if held is None or _claim_dead(held[0], time.monotonic() - seen[1]):
            try:
                version = store.put_if(claim, _claim_bytes(part, 0), version)
            except PreconditionFailed:
                continue  # another task claimed it first
            return _make_claimed(store, claim, version, ready, make, part)
        if not block:
            return None
        if time.monotonic() > deadline:
            holder = json.loads(held[0])
            raise UsageError(
                f"{store.url('').rstrip('/')}: waited {wait_s:.0f} s for {what} that part "
                f"{holder.get('part')} (host {holder.get('host')}, pid {holder.get('pid')}) is making; it "
                f"still runs (its claim {store.url(claim)} is renewed): raise --plan-wait"
            )
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def _make_claimed(
    store, claim: str, version: str, ready: Callable[[], T | None], make: Callable[[], T], part: int
) -> T:
    result = ready()  # the previous holder may have finished between our reads
    held = [version]
    try:
        if result is None:
            with _heartbeat(store, claim, version, part) as held:
                result = make()
    finally:  # a task that fails (bad input) releases the claim too: no task waits out its staleness
        release(store, claim, held[0])
    return result


def release(store, claim: str, version: str | None) -> None:
    """Only a claim still ours is deleted: one a task took over while this one was thought dead is
    that task's until it finishes. A local store's compare-and-swap leaves a lock file beside it."""
    current = store.get_versioned(claim)
    if current is not None and current[1] == version:
        store.delete([claim, f"{claim}.lock"])


def _claim_bytes(part: int, beat: int) -> bytes:
    return json.dumps({"part": part, "host": socket.gethostname(), "pid": os.getpid(), "beat": beat}).encode()


def _claim_dead(data: bytes, unchanged_s: float) -> bool:
    """Judged by this task's own clock (no clock is shared between nodes): the claim has not been
    renewed for CLAIM_STALE_S, or its writer was on this host and is gone."""
    holder = json.loads(data)
    if holder.get("host") == socket.gethostname() and not process_alive(int(holder.get("pid", 0))):
        return True
    return unchanged_s > CLAIM_STALE_S


@contextlib.contextmanager
def _heartbeat(store, claim: str, version: str, part: int):
    """Renew the claim every CLAIM_STALE_S / 4 while working, so waiting tasks see it is alive.
    Yields [the claim's version as this task last wrote it], None once another task took it over."""
    stop = threading.Event()
    held: list[str | None] = [version]

    def beat():
        beats = 0
        while not stop.wait(CLAIM_STALE_S / 4):
            beats += 1
            try:
                held[0] = store.put_if(claim, _claim_bytes(part, beats), held[0])
            except PreconditionFailed:
                held[0] = None
                log.warning(
                    "another task took over %s (this one was thought dead); both write the same bytes", store.url(claim)
                )
                return
            except StorageError as e:
                log.warning("could not renew the claim %s: %s", store.url(claim), e)

    thread = threading.Thread(target=beat, name="claim", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        stop.set()
        thread.join()
