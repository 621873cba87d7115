"""Retry what is transient, with exponential backoff and a bound on the total time; fail at once
on what a retry cannot fix (absent, forbidden, bad signature), naming what was tried."""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Callable, TypeVar

from .errors import StorageError

T = TypeVar("T")
log = logging.getLogger("vitforge.retry")

# Errors a retry cannot fix: the object is absent, we may not read it, or the store said no.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StorageError)


class TransientError(OSError):
    """Worth another try: a throttled or failed request, a reset connection, a body cut short."""


def retry_seconds() -> float:
    """Total time one operation may spend retrying (VITFORGE_RETRY_SECONDS, default 60)."""
    return float(os.environ.get("VITFORGE_RETRY_SECONDS", "60"))


def with_retries(fn: Callable[[], T], what: str, attempts: int = 6, base_delay: float = 0.2) -> T:
    deadline = time.monotonic() + retry_seconds()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except PERMANENT:
            raise
        except Exception as e:  # storage clients raise many unrelated types for one flaky network
            delay = base_delay * 2 ** (attempt - 1) * (0.5 + random.random())
            if attempt == attempts or time.monotonic() + delay > deadline:
                raise StorageError(f"{what}: failed after {attempt} attempts: {type(e).__name__}: {e}") from None
            log.warning("%s: %s: %s; retry %d/%d in %.1fs", what, type(e).__name__, e, attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
