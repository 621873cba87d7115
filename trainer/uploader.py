"""A checkpoint's upload in the background: one thread per rank at the lowest CPU priority, so that
training keeps the cores while the files go to the store."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from vitforge.core import StorageError, VitforgeError

log = logging.getLogger("vitforge.checkpoint")


UPLOAD_NICE = 19  # the lowest CPU priority: the upload takes only the CPU time training leaves


def lower_thread_priority(nice: int) -> bool:
    """Lower the calling thread's CPU priority to `nice`; whether it could. On Linux nice is per
    thread and every thread this one starts inherits it, so an uploader thread that calls this
    first covers the file and part threads it starts. Nice rather than SCHED_IDLE: a niced
    thread still gets a small share on a node whose loader keeps every core busy (SCHED_IDLE
    would get none, and the next save would wait for an upload that never ends). Where the OS
    refuses or has no per-thread nice, the upload runs at normal priority: slower training
    during it, never a failed upload."""
    if not sys.platform.startswith("linux"):  # elsewhere a thread id is no PRIO_PROCESS target
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except OSError as e:  # a sandbox that forbids it
        log.info("checkpoint uploads run at normal CPU priority: %s", e)
        return False


class Uploader:
    """One background thread per rank, at the lowest CPU priority (lower_thread_priority), with the
    threads it starts (RunStore.upload_folder bounds them); its failure is raised on the main
    thread at the next wait."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, work) -> None:
        def run():
            try:
                lower_thread_priority(UPLOAD_NICE)
                work()
            except BaseException as e:  # re-raised on the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name="vitforge-upload", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Block until the upload in flight is done; return the seconds waited."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, VitforgeError):
                raise error
            raise StorageError(f"checkpoint upload failed: {type(error).__name__}: {error}") from error
        return time.perf_counter() - start
