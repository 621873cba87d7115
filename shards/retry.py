"""Retry transient storage failures with exponential backoff, then fail naming what was tried."""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# Errors a retry cannot fix: the object is absent or we may not read it.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def with_retries(fn: Callable[[], T], what: str, attempts: int = 6, base_delay: float = 0.2) -> T:
    for attempt in range(1, attempts):
        try:
            return fn()
        except PERMANENT:
            raise
        except Exception as e:  # storage clients raise many unrelated types for one flaky network
            delay = base_delay * 2 ** (attempt - 1) * (0.5 + random.random())
            log.warning("%s: %s: %s; retry %d/%d in %.1fs", what, type(e).__name__, e, attempt, attempts - 1, delay)
            time.sleep(delay)
    try:
        return fn()
    except PERMANENT:
        raise
    except Exception as e:
        raise OSError(f"{what}: failed after {attempts} attempts: {type(e).__name__}: {e}") from e
