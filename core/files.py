"""Local files written all-or-nothing, and their checksums."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Iterator

PARTIAL_MARK = ".partial-"


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def atomic_path(path: str, tmp: str | None = None) -> Iterator[str]:
    """Yield a temporary name (beside `path` unless given: it must be on the same filesystem);
    rename it into place only if the block succeeds."""
    tmp = tmp or f"{path}{PARTIAL_MARK}{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str, data: bytes, tmp: str | None = None) -> None:
    with atomic_path(path, tmp) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
