"""One job owns a run at a time: the lease object `lease.json` in the run's folder, rewritten by the
holder's rank 0 every few seconds and judged by any other job on its own monotonic clock (Lease
says how). Plain I/O over the run's store: no torch, no collectives."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from vitforge.core import PreconditionFailed, StorageError, process_alive, scheduler_env

from .run_store import LEASE, RunStore, published_tags, step_of
from .run_store import parse_record as _parse

log = logging.getLogger("vitforge.checkpoint")  # the checkpointer's log: the lease is its part


def job_identity() -> dict:
    """Who is training. A scheduler's job keeps its id across requeues, so a requeued job owns its
    run; its incarnation (the scheduler's restart count) tells a requeued copy from a stale older one.
    Outside a scheduler's job, this process is the job."""
    place = scheduler_env()
    host, pid = socket.gethostname(), os.getpid()
    return {
        "job": place.job or f"{host}:{pid}:{time.time_ns()}",
        "incarnation": place.restart_count,
        "host": host,
        "pid": pid,
    }


HELD, RELEASED = "held", "released"
BEAT_MAX_S = 5.0  # a second job is refused within about this long, whatever lease_minutes is


class Lease:
    """One job owns a run at a time. Every write of the lease object is a compare-and-swap on its
    version (S3 If-Match / If-None-Match on the ETag, the sha256 under a lock file locally), so a
    second job can neither take a live run nor move `latest` after it lost the lease.

    Liveness trusts no clock shared between hosts. The holder rewrites the lease every
    min(lease/4, 5 s) with a new beat number, so its version changes. A job that finds the run held
    by another job watches that version with its own monotonic clock: if it changes within the
    holder's lease period (the longer of the two jobs' periods), the holder is alive and the job is
    refused; if it does not change for the whole period, the holder is dead and its lease is taken
    with If-Match on the version watched. A wall-clock time is written for humans only.
    Taken at once: a free or released lease, a holder whose process is gone on this host, and an
    older incarnation of the same SLURM job (SLURM requeued it; the compare-and-swap fences the old
    copy). A newer incarnation is never taken by an older one, which then fails its next refresh; a
    second live copy of the same incarnation (another srun step) is watched like another job. A lease
    write that landed but whose reply was lost (the client retries it and is refused) is recognised
    as this job's own and kept, not mistaken for a lost run.

    The record also carries the run's id (made by its first holder, kept by every later one), the
    holder's epoch (one more than the previous holder's) and the published checkpoints: a checkpoint
    is complete only once `publish` listed its tag, in a write conditional on the version this job
    wrote last (its fencing token). A stale copy's manifest that lands after a takeover is thus never
    part of the run: its publish is refused by the store (412), whatever its retries carried. Each
    published tag keeps its publisher's epoch, so a stale manifest that lands over a step the new
    holder published again is refused too (RunStore.manifest).

    Cost: rank 0 only; one object of about 250 bytes plus 20 per retained checkpoint (retention
    bounds the list), one PUT per beat (720 an hour at most); a job that must judge a holder does one
    GET per min(lease/8, 1 s) for at most one lease period."""

    def __init__(self, run: RunStore, minutes: float, me: dict | None = None):
        self.run, self.seconds = run, minutes * 60
        self.beat_s, self.poll_s = min(self.seconds / 4, BEAT_MAX_S), min(self.seconds / 8, 1.0)
        self.me = me or job_identity()
        self.version: str | None = None  # of the record this job wrote last: its fencing token
        self.run_id: str | None = None  # made by the run's first holder, kept by every later one
        self.epoch = 0  # one more than the previous holder's
        # the published tags, each with its publisher's epoch; None: a lease from before the list
        self.checkpoints: dict[str, int | None] | None = None
        self.beats = 0
        self.lost = False
        self._watching: tuple[str, float] | None = None  # (version, monotonic start) of a watch under way
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lease; return a note when it was taken over from another holder. Raises a
        StorageError naming the holder when it is alive or a newer incarnation of this job."""
        while True:
            taken, note = self.try_acquire(math.inf)
            if taken:
                return note

    def try_acquire(self, within: float) -> tuple[bool, str | None]:
        """`acquire`, giving up after `within` seconds of watching another job's holder: then
        (False, None), and the next call goes on with the same watch. So a caller that others wait
        for in a collective can keep each wait short. (True, note) once taken."""
        end = time.monotonic() + within
        with self.lock:
            while True:
                current = self.run.store.get_versioned(LEASE)
                holder = _parse(current[0]) if current is not None else {}
                note = None
                if current is not None:
                    note = self._take_at_once(holder)
                    if note is None:
                        verdict = self._watch(holder, current[1], end)
                        if verdict != "dead":
                            if verdict == "pending":
                                return False, None
                            continue  # released or removed while watched: judge it again
                        note = (
                            f"took over {self.run.url} from job {_who(holder)}: its lease did not change "
                            f"for {self._period(holder):.0f} s"
                        )
                self.run_id = holder.get("run_id") or uuid.uuid4().hex
                self.epoch = _int(holder.get("epoch")) + 1
                self.checkpoints = published_tags(holder)
                try:
                    self.version = self._write(current[1] if current else None, HELD)
                except PreconditionFailed:
                    continue  # another job wrote it since it was read: judge the new holder
                self.lost, self._watching = False, None
                return True, note or None

    def _take_at_once(self, holder: dict) -> str | None:
        """A note when `holder` may be replaced without watching ("" for no note); None when it
        must be watched. Raises if this is a stale incarnation of the holder's job."""
        mine, theirs = int(self.me.get("incarnation", 0)), _int(holder.get("incarnation"))
        same_job = holder.get("job") == self.me["job"]
        if same_job and theirs > mine:
            raise StorageError(
                f"{self.run.url} is held by restart {theirs} of job {self.me['job']} on {holder.get('host')} "
                f"(pid {holder.get('pid')}); this process is restart {mine}, a stale copy that SLURM requeued "
                "since: it must not touch the run"
            )
        if holder.get("state") == RELEASED:
            return ""
        if same_job and theirs < mine:
            return f"took over {self.run.url} from restart {theirs} of this job (SLURM requeued it)"
        if holder.get("host") == self.me["host"] and not process_alive(_int(holder.get("pid"))):
            # of this very incarnation: e.g. workers restarted by torchrun
            return "" if same_job else f"took over {self.run.url} from job {_who(holder)}: its process is gone"
        return None  # alive elsewhere, or a second live copy of this incarnation (another srun step)

    def _period(self, holder: dict) -> float:
        return max(self.seconds, _number(holder.get("lease_s"), float))

    def _watch(self, holder: dict, version: str, end: float) -> str:
        """Watch the lease at `version` for the holder's lease period on this host's monotonic clock,
        until `end` at most: "dead" when it never changed, "gone" when it was released or removed
        meanwhile, "pending" at `end`; raises naming the holder when it changed (it is alive)."""
        if self._watching is not None and self._watching[0] != version:
            self._watching = None  # it changed between two calls, and is held: its holder is alive
            raise self._alive(holder)
        period = self._period(holder)
        if self._watching is None:
            log.info(
                "%s is held by job %s; watching its lease for up to %.0f s to tell whether it is alive",
                self.run.url,
                _who(holder),
                period,
            )
            self._watching = (version, time.monotonic())
        while (waited := time.monotonic() - self._watching[1]) < period:
            if time.monotonic() >= end:
                return "pending"
            time.sleep(max(0.0, min(self.poll_s, period - waited, end - time.monotonic())))
            now = self.run.store.get_versioned(LEASE)
            if now is not None and now[1] == version:
                continue
            self._watching = None
            changed = _parse(now[0]) if now is not None else {"state": RELEASED}
            if changed.get("state") == RELEASED:
                return "gone"
            raise self._alive(changed)
        return "dead"

    def _alive(self, holder: dict) -> StorageError:
        return StorageError(
            f"{self.run.url} is in use by job {_who(holder)}: its lease changed while this job watched it, "
            "so it is alive; two jobs must not write one run. Use another checkpoint.run, or stop that job"
        )

    def refresh(self) -> None:
        """Renew the lease; fails if another job took the run meanwhile."""
        with self.lock:
            if self.version is None:
                raise StorageError(f"{self.run.url}: this job does not hold the run's lease (released or never taken)")
            try:
                self.version = self._write(self.version, HELD)
            except PreconditionFailed:
                self.lost = True
                current = self.run.store.get_versioned(LEASE)
                holder = _who(_parse(current[0])) if current else "nobody (the lease was deleted)"
                raise StorageError(
                    f"{self.run.url}: this job lost ownership of the run to {holder}; "
                    "stopping without touching its checkpoints"
                ) from None

    def publish(self, tag: str) -> None:
        """The commit point of checkpoint `tag`: its name joins the published list in a write
        conditional on the version this job wrote last, so a copy that lost the run (a partitioned
        host's, whose manifest landed after the takeover) is refused by the store itself and its
        checkpoint never counts as complete (RunStore.complete_tags)."""
        with self.lock:
            self.checkpoints = dict(
                sorted({**(self.checkpoints or {}), tag: self.epoch}.items(), key=lambda kv: step_of(kv[0]))
            )
        self.refresh()

    def forget(self, tags: list[str]) -> None:
        """Deleted (or about to be saved again) checkpoints leave the list with the next write."""
        with self.lock:
            self.checkpoints = {t: e for t, e in (self.checkpoints or {}).items() if t not in tags}

    def start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.beat_s):
                try:
                    self.refresh()
                except Exception as e:  # lost: the next checkpoint's refresh reports it on the main path
                    if self.lost or self.version is None:
                        return
                    log.warning(
                        "could not renew the lease of %s (retrying in %.0f s): %s", self.run.url, self.beat_s, e
                    )

        self._thread = threading.Thread(target=beat, name="vitforge-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Mark the lease released, only if it is still this job's version: a stale copy can never
        release (or remove) the lease of the job that replaced it. A released lease is taken at once."""
        self._stop.set()
        with self.lock:
            if self.version is None or self.lost:
                return
            try:
                self._write(self.version, RELEASED)
            except PreconditionFailed:
                log.info("%s: not released: another job holds the lease now", self.run.url)
            self.version = None

    def _write(self, version: str | None, state: str) -> str:
        self.beats += 1  # every write differs, so the version (ETag, sha256) changes with every beat
        record = {
            **self.me,
            "state": state,
            "beat": self.beats,
            "lease_s": self.seconds,
            "run_id": self.run_id,
            "epoch": self.epoch,
            **({} if self.checkpoints is None else {"checkpoints": self.checkpoints}),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ (this host's clock, for humans)", time.gmtime()),
        }
        try:
            return self.run.store.put_if(LEASE, json.dumps(record, sort_keys=True).encode(), version)
        except PreconditionFailed:
            # A write that landed but whose reply was lost is retried by the client against the old
            # version and refused: the record there is then this very write, which is ours to keep.
            current = self.run.store.get_versioned(LEASE)
            if current is not None and _parse(current[0]) == {
                **record,
                "written_at": _parse(current[0]).get("written_at"),
            }:
                return current[1]
            raise


def _who(holder: dict) -> str:
    restart = f" (restart {holder['incarnation']})" if _int(holder.get("incarnation")) else ""
    return f"{holder.get('job')}{restart} on {holder.get('host')} (pid {holder.get('pid')})"


def _int(value) -> int:
    return _number(value, int)


N = TypeVar("N", int, float)


def _number(value, kind: Callable[[Any], N]) -> N:
    """A number from another job's lease record; 0 when it lacks one or wrote something else."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        return 0
