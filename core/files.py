"""Local files written all-or-nothing, and their checksums."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

PARTIAL_MARK = ".partial-"
# Local folders come and go under a writer: a store removes a folder once it is empty (an object
# store has none to keep), and whichever sharding task finishes first removes the shared work
# folder. Each removal costs a writer one more try, so the bound is never reached by accident.
TRIES = 100
# How a folder removed under a writer shows: ENOENT here, ESTALE from NFS when another node removed it.
_GONE = (errno.ENOENT, errno.ESTALE)
T = TypeVar("T")


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def atomic_path(path: str, tmp: str | None = None) -> Iterator[str]:
    """Yield a temporary name (beside `path` unless given: it must be on the same filesystem);
    rename it into place only if the block succeeds, making `path`'s folder if it is missing."""
    tmp = tmp or f"{path}{PARTIAL_MARK}{os.getpid()}"
    try:
        yield tmp
        replace_into(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def make_folder(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)` that a concurrent removal of `path` or a parent cannot
    fail (makedirs itself raises FileExistsError when the folder goes between its two checks)."""
    for _ in range(TRIES):
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno not in _GONE:
                raise
    os.makedirs(path, exist_ok=True)


def create_file(path: str, mode: str = "wb", buffering: int = -1):
    """`open(path, mode)` for writing, its folder (and any parent missing) made again when it
    vanished before the file was created. Once the file exists its folder is not empty, so
    nothing removes it."""
    return _in_folder(lambda: open(path, mode, buffering=buffering), os.path.dirname(path))


def replace_into(src: str, path: str) -> None:
    """`os.replace(src, path)`, `path`'s folder (and any parent missing) made when it is missing."""
    _in_folder(lambda: os.replace(src, path), os.path.dirname(path), lambda: os.path.exists(src))


def _in_folder(action: Callable[[], T], folder: str, may_retry: Callable[[], bool] = lambda: True) -> T:
    """`action()`, retried with `folder` made again while it fails because a folder vanished
    (and `may_retry()`: a missing source is no vanished folder)."""
    for _ in range(TRIES):
        try:
            return action()
        except OSError as e:
            if e.errno not in _GONE or not may_retry():
                raise
            make_folder(folder)
    return action()


def atomic_write(path: str, data: bytes, tmp: str | None = None) -> None:
    with atomic_path(path, tmp) as tmp, create_file(tmp) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
