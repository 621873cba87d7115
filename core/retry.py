"""Bounds on every object-store operation, and retries within them.

Each attempt may take `VITFORGE_STORE_CONNECT_TIMEOUT_S` to connect and wait
`VITFORGE_STORE_READ_TIMEOUT_S` for each read; a request makes at most `AWS_MAX_ATTEMPTS` attempts;
and a request, or a retried operation with all its requests, gives up at its first failure after
`VITFORGE_STORE_DEADLINE_S`. So a store that accepts connections and never answers fails within
the deadline plus one attempt (at most 250 s with the defaults), with a log line per failed attempt.
Transient failures are retried with exponential backoff; what a retry cannot fix (absent,
forbidden, bad signature) fails at once, naming what was tried.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from .errors import StorageError, UsageError

T = TypeVar("T")
log = logging.getLogger("vitforge.retry")

# Errors a retry cannot fix: the object is absent, we may not read it, or the store said no.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StorageError)


def failure_kind(error: BaseException) -> str:
    """How a failed store operation ends, decided here for every store: "usage" (a name or an
    argument the client refused before sending anything, e.g. google's ValueError for a bad
    bucket name: the user's to fix, exit 2 at once), "permanent" (absent, refused: fails at once),
    "transient" (anything else a network or a service can do: retried within the bounds)."""
    if isinstance(error, TransientError):
        return "transient"
    if isinstance(error, UsageError) or (isinstance(error, ValueError) and not isinstance(error, UnicodeError)):
        return "usage"  # a body that fails to parse is transient: it raises UnicodeError or a client's own type
    return "permanent" if isinstance(error, PERMANENT) else "transient"


class TransientError(OSError):
    """Worth another try: a throttled or failed request, a reset connection, a body cut short."""


@dataclass(frozen=True)
class StoreLimits:
    """Defaults suit a real cloud: a slow first byte from S3 is seconds, not a minute."""

    connect_timeout_s: float = 10
    read_timeout_s: float = 60
    deadline_s: float = 180
    attempts: int = 5  # per request, the first one included

    def botocore_config(self) -> dict:
        """Keyword arguments for botocore's (and aiobotocore's) `Config`."""
        return {
            "connect_timeout": self.connect_timeout_s,
            "read_timeout": self.read_timeout_s,
            "retries": {"mode": os.environ.get("AWS_RETRY_MODE", "standard"), "total_max_attempts": self.attempts},
        }


def store_limits() -> StoreLimits:
    """The bounds from the environment, read at each use so a test or a job can set them."""
    default = StoreLimits()
    return StoreLimits(
        _positive("VITFORGE_STORE_CONNECT_TIMEOUT_S", default.connect_timeout_s),
        _positive("VITFORGE_STORE_READ_TIMEOUT_S", default.read_timeout_s),
        _positive("VITFORGE_STORE_DEADLINE_S", default.deadline_s),
        int(_positive("AWS_MAX_ATTEMPTS", default.attempts, whole=True)),
    )


def _positive(name: str, default: float, whole: bool = False) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf) or (whole and not value.is_integer()):
        raise UsageError(f"{name}={text}: expected a positive {'whole number' if whole else 'number of seconds'}")
    return value


@dataclass(frozen=True)
class Operation:
    what: str
    deadline: float  # time.monotonic() after which a failure is final


_operation: ContextVar[Operation | None] = ContextVar("vitforge_store_operation", default=None)


@contextlib.contextmanager
def operation(what: str) -> Iterator[Operation]:
    """One deadline for everything `what` does in this thread (or asyncio task), store requests
    included; an inner operation keeps the outer deadline, so nested retries never add up."""
    outer = _operation.get()
    if outer is not None:
        yield outer
        return
    current = Operation(what, time.monotonic() + store_limits().deadline_s)
    token = _operation.set(current)
    try:
        yield current
    finally:
        _operation.reset(token)


def current_operation() -> Operation | None:
    return _operation.get()


def past_deadline(what: str, attempts: int, error: str) -> StorageError:
    return StorageError(
        f"{what}: still failing when the {store_limits().deadline_s:g} s deadline passed "
        f"({attempts} attempts, last: {error}); VITFORGE_STORE_DEADLINE_S sets it"
    )


def with_retries(fn: Callable[[], T], what: str, attempts: int = 6, base_delay: float = 0.2) -> T:
    with operation(what) as bound:
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except Exception as e:  # storage clients raise many unrelated types for one flaky network
                kind = failure_kind(e)
                if kind == "usage" and not isinstance(e, UsageError):
                    raise UsageError(f"{what}: {e}") from None
                if kind != "transient":
                    raise
                delay = base_delay * 2 ** (attempt - 1) * (0.5 + random.random())
                if attempt == attempts:
                    raise StorageError(f"{what}: failed after {attempt} attempts: {type(e).__name__}: {e}") from None
                if time.monotonic() + delay > bound.deadline:
                    raise past_deadline(what, attempt, f"{type(e).__name__}: {e}") from None
                log.warning(
                    "%s: attempt %d/%d failed: %s: %s; next in %.1f s",
                    what,
                    attempt,
                    attempts,
                    type(e).__name__,
                    e,
                    delay,
                )
                time.sleep(delay)
    raise AssertionError("unreachable")


def with_retries_if_present(fn: Callable[[], T], what: str) -> T | None:
    """with_retries(fn, what), or None when what it reads does not exist (FileNotFoundError, never retried)."""
    try:
        return with_retries(fn, what)
    except FileNotFoundError:
        return None
