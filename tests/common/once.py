"""Expensive things built once per pytest run, however many xdist workers ask for them.

A session fixture is made once per worker process, so four workers would train a shared reference
run four times. `built_once` keeps one copy in the folder the run's workers share (pytest-N/, the
parent of each worker's own base folder): the first worker to ask builds it under a file lock, the
others wait on the lock and reuse what it built. A build that failed leaves no completion mark, so
the next worker to ask builds it again (and fails with its own message).
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path


def shared_folder(tmp_path_factory, worker_id: str) -> Path:
    """The folder every worker of this run sees: pytest-N/ under xdist, the base folder without it
    (a plain run's parent holds earlier runs' folders, which must not be reused)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id != "master" else base


def built_once(tmp_path_factory, worker_id: str, name: str, build: Callable[[Path], None]) -> Path:
    """`name`'s folder in the shared folder, filled by `build(folder)` once per run."""
    shared = shared_folder(tmp_path_factory, worker_id)
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an exception
        if not (shared / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (shared / f"{name}.done").touch()
    return folder
