"""Every rank's hang watchdog: a step, checkpoint save or evaluation that does not finish in time
ends the job with exit code 76 (HUNG) and leaves the evidence, instead of a job that sits in a
collective until its time limit.

The main thread marks progress: `beat` after each finished step, `phase` around a checkpoint save
or an evaluation. A thread compares it with the clock about once a second. The first beat arms it:
start-up, JIT builds and the first step are not guarded (the rendezvous and collective timeouts are).

The timeout is train.hang_timeout_s or, when null, max(train.hang_floor_s, 20 x the median of the
last 64 step times): a step 20 times slower than usual is a hang, never one within the floor. A
phase gets the timeout plus an allowance of its own, since it may legitimately outlast any step:
the one the trainer names for it (a checkpoint save: twice checkpoint.upload_timeout_minutes, as a
save may wait for the previous upload and, at a stop or the end, for its own, and the checkpointer
gives up by itself after that), else (an evaluation) three times its longest earlier run in this
invocation, at least hang_floor_s (the first one's length is unknown). The time from a phase's end
to the next beat is no step time.

A collective gives up by itself after train.collective_timeout_s, and its ranks then leave with no
stacks and no exit code 76: the watchdog must expire first. The configuration rejects a
hang_timeout_s or hang_floor_s set to no less than it, and 20 x the median step time counts for at
most 0.9 x it: a collective starts after the beat the watchdog measures from, and rank 0's report
follows the expiry by a grace period of a tenth of the timeout (from 30 s on), so 0.9 x 1.1 < 1
lets the report finish before the collective gives up. The cap does not lower the floor: where a
run shortens collective_timeout_s below the default floor, the collective timeout is its hang
detector (on gloo, exit code 75 naming the lost peer's host). The watchdog also catches what hangs
outside a collective (a loader, a store, a deadlock).

On expiry each rank, from the watchdog thread (its main thread is stuck and cannot raise):
1. writes the stack of every thread (faulthandler), the collectives its flight recorder holds and,
   with `py-spy` on PATH, the native frames (`py-spy dump --native`), to
   RUN/debug/STEP-rankR-HOST.txt in the run's store, STEP being the step it was in (to stderr
   when the store does not take it);
2. sets one key in the rendezvous store (rank 0's TCPStore) with its step and where its main thread
   is. Rank 0, after a grace period, reads every rank's key and logs the ranks with none as not
   reaching the collective the others wait in (frozen, dead, or their host is), with their host,
   and where the others are. A rank that cannot reach the store logs that rank 0 is the one stuck;
3. rank 0 writes 76 to VITFORGE_EXIT_FILE, and every rank leaves with os._exit(76) once rank 0 has
   reported (so srun's --kill-on-bad-exit ends no rank before its stacks are stored). A frozen
   rank 0 writes nothing: a rank that finds its store unreachable writes 76 there itself unless a
   verdict is there already (the first writer wins; rank 0's own, when it comes, overwrites it),
   so that the job still requeues as hung.

Per rank in normal running: O(1), and no store traffic: a beat is a clock read and an append to a
64-entry deque, and one thread wakes about once a second. At a hang: one store connection and a
few keys per rank; rank 0 alone reads O(world) keys, once.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from vitforge.core import SchedulerEnv, record_exit_code
from vitforge.core.errors import HUNG

from .peers import PeerWatch, connect_to_rendezvous
from .run_store import RunStore

log = logging.getLogger("vitforge.watchdog")
MULTIPLE = 20  # a step this many times the median step time is hung
RECENT = 64  # step times the median is taken over
PHASE_MULTIPLE = 3  # a phase may take this many times its longest earlier run
COLLECTIVE_SHARE = 0.9  # the step-time sizing's cap, as a share of train.collective_timeout_s
KEY = "vitforge/hang/"
STORE_S = 10.0  # each store operation at a hang gives up after this
WRITE_S = 120.0  # the longest a rank waits for its stacks to reach the store
SPY_S = 60.0
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)


def auto_timeout(step_times, floor_s: float, cap_s: float, multiple: float = MULTIPLE) -> float:
    """max(floor_s, min(cap_s, multiple x the median of `step_times`)); floor_s while none is known."""
    return max(floor_s, min(cap_s, multiple * statistics.median(step_times))) if step_times else floor_s


class Progress(NamedTuple):
    """What the main thread marked last. Replaced whole, in one assignment, so that the watchdog
    thread never reads half an update (a phase's end without the time it ended)."""

    last: float | None  # the monotonic time of the last progress; None: not armed
    step: int  # the last finished step
    timed: bool  # whether the time from `last` to the next beat is a whole step
    phase: tuple[str, float] | None  # the phase under way: name, monotonic start


class Watchdog:
    def __init__(
        self,
        timeout_s: float | None,
        floor_s: float,
        collective_timeout_s: float,
        allowances: dict[str, float] | None = None,
    ):
        self.fixed, self.floor, self.cap = timeout_s, floor_s, COLLECTIVE_SHARE * collective_timeout_s
        self.allowances = allowances or {}  # a phase's allowance by name; others: PHASE_MULTIPLE x longest
        self.progress = Progress(None, 0, False, None)
        self.times: deque[float] = deque(maxlen=RECENT)
        self.longest: dict[str, float] = {}
        self._stop = threading.Event()
        self.env: SchedulerEnv | None = None  # these three: from start()
        self.run: RunStore | None = None
        self.master_host: str | None = None

    # -- the main thread ---------------------------------------------------------------------
    def beat(self, step: int) -> None:
        now, progress = time.monotonic(), self.progress
        if progress.timed:
            self.times.append(now - progress.last)
        self.progress = progress._replace(last=now, step=step, timed=True)

    @contextmanager
    def phase(self, name: str):
        start = time.monotonic()
        self.progress = self.progress._replace(phase=(name, start))
        try:
            yield
        finally:
            now, progress = time.monotonic(), self.progress
            self.longest[name] = max(self.longest.get(name, 0.0), now - start)
            self.progress = (
                progress._replace(phase=None)
                if progress.last is None  # not armed: stays so
                else progress._replace(last=now, timed=False, phase=None)
            )

    # -- the watchdog thread -----------------------------------------------------------------
    def timeout(self) -> float:
        return self.fixed if self.fixed is not None else auto_timeout(sorted(self.times), self.floor, self.cap)

    def overdue(self, now: float) -> tuple[str, int, float] | None:
        """(what hung, the step it belongs to, the limit it exceeded), or None while all is well."""
        (last, step, _, phase), limit = self.progress, self.timeout()
        if last is None:
            return None
        if phase is None:
            what, step, since = f"step {step + 1}", step + 1, last
        else:
            name, since = phase
            limit += self.allowances.get(name, max(self.floor, PHASE_MULTIPLE * self.longest.get(name, 0.0)))
            what = f"{name} after step {step}"
        return (what, step, limit) if now - since > limit else None

    def start(self, env: SchedulerEnv, run: RunStore, master_host: str) -> Watchdog:
        """Watch from now on; `run`: where the stacks go; `master_host`: rank 0's host, named when
        its store does not answer."""
        self.env, self.run, self.master_host = env, run, master_host
        poll = min(1.0, self.timeout() / 4)

        def watch() -> None:
            while not self._stop.wait(poll):
                hung = self.overdue(time.monotonic())
                if hung is not None and not self._stop.is_set():
                    self._fire(*hung)

        threading.Thread(target=watch, name="vitforge-hang-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _fire(self, what: str, step: int, limit: float) -> None:
        try:
            self._report_hang(what, step, limit)
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HUNG)

    def _report_hang(self, what: str, step: int, limit: float) -> None:
        fired, rank, host = time.monotonic(), self.env.rank, socket.gethostname()
        at = datetime.now(UTC).isoformat(timespec="milliseconds")
        name = f"debug/{step}-rank{rank}-{host}.txt"
        where = main_thread_frame()
        log.error(
            "rank %d (host %s): %s did not finish within %.0f s (main thread in %s): writing every thread's "
            "stack to %s, then ending with exit code %d",
            rank,
            host,
            what,
            limit,
            where,
            self.run.object_url(name),
            HUNG,
        )
        if rank == 0:
            try:  # first: srun may end this rank as soon as another one leaves
                record_exit_code(HUNG)
            except OSError as e:
                log.error("could not write the exit code to VITFORGE_EXIT_FILE: %s", e)
        path = write_stacks(
            f"rank {rank} (host {host}, pid {os.getpid()}): {what} did not finish within "
            f"{limit:.0f} s; main thread in {where}; fired at {at}\n"
        )
        stored = threading.Event()

        def store_stacks() -> None:
            self.run.upload(path, name)
            stored.set()

        writer = threading.Thread(target=store_stacks, name="vitforge-hang-stacks", daemon=True)
        writer.start()
        grace = min(60.0, max(3.0, limit / 10))  # for the other ranks' watchdogs to expire too
        store = self._connect()
        if store is not None:
            try:
                store.set(f"{KEY}{rank}", json.dumps({"what": what, "where": where, "host": host}))
            except Exception as e:  # whatever the store raises, it does not answer
                self._unreachable(e)
                store = None
        writer.join(WRITE_S)
        if stored.is_set():
            os.unlink(path)
        else:
            log.error(
                "rank %d: the stacks did not reach %s within %.0f s; here they are:\n%s",
                rank,
                self.run.object_url(name),
                WRITE_S,
                Path(path).read_text(errors="replace"),
            )
        if store is not None:
            self._finish_report(store, what, limit, fired, grace)

    def _finish_report(self, store: dist.TCPStore, what: str, limit: float, fired: float, grace: float) -> None:
        """Through the rendezvous store: every rank counts itself done; rank 0 waits out the grace,
        summarises and waits for the reporting ranks' stacks, and the others for its summary."""
        rank = self.env.rank
        try:
            store.add(f"{KEY}done", 1)
            if rank == 0:
                time.sleep(max(0.0, grace - (time.monotonic() - fired)))
                reports = self._summarise(store, what, limit)
                deadline = time.monotonic() + WRITE_S  # the reporting ranks' stacks, stored before anyone leaves
                while store.add(f"{KEY}done", 0) < reports and time.monotonic() < deadline:
                    time.sleep(0.2)
                store.set(f"{KEY}reported", "1")
            else:
                store.wait([f"{KEY}reported"], timedelta(seconds=grace + 2 * WRITE_S))
        except Exception as e:  # leaving is all that is left to do
            log.error("rank %d: the hang report did not complete: %s", rank, e)

    def _connect(self) -> dist.TCPStore | None:
        try:
            return connect_to_rendezvous(self.env, STORE_S)
        except Exception as e:  # whatever it raises, the store does not answer
            self._unreachable(e)
            return None

    def _unreachable(self, error: Exception) -> None:
        """Says what an unreachable store means (the caller goes on without it)."""
        if self.env.rank == 0:
            log.error("rank 0: its own rendezvous store failed (%s): no report of the other ranks", error)
        else:
            log.error(
                "rank %d: rank 0's rendezvous store (host %s, %s:%d) does not answer (%s): rank 0 is the one "
                "stuck, or its host is (unless it left already)",
                self.env.rank,
                self.master_host,
                self.env.master_addr,
                self.env.master_port,
                error,
            )
            try:  # a frozen rank 0 records no verdict: without one the job would not requeue as hung
                record_exit_code(HUNG, claim=True)
            except OSError as e:
                log.error("could not write the exit code to VITFORGE_EXIT_FILE: %s", e)
        return None

    def _summarise(self, store: dist.TCPStore, what: str, limit: float) -> int:
        """Rank 0: log who did not report (each with its host) and where the others are; returns
        how many reported. O(world) store reads, once."""
        env = self.env
        reports = {r: json.loads(store.get(f"{KEY}{r}")) for r in range(env.world_size) if store.check([f"{KEY}{r}"])}
        silent: dict[str, list[int]] = {}
        for r in range(env.world_size):
            if r not in reports:
                key = PeerWatch.host_key(r // env.local_world_size)
                host = store.get(key).decode() if store.check([key]) else "unregistered"
                silent.setdefault(host, []).append(r)
        places: dict[str, list[int]] = {}
        for r, report in sorted(reports.items()):
            places.setdefault(f"{report['what']} in {report['where']}", []).append(r)
        missing = "; ".join(f"{_ranks(ranks)} (host {host})" for host, ranks in silent.items())
        log.error(
            "hang (%s, timeout %.0f s): %s; %s; every reporting rank's stacks are in %s",
            what,
            limit,
            f"did not reach the collective (no watchdog report: frozen, dead or cut off): {missing}"
            if silent
            else "every rank reported (none is frozen: see where each one is)",
            "; ".join(f"{_ranks(ranks)}: {place}" for place, ranks in places.items()),
            self.run.object_url("debug/"),
        )
        return len(reports)


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def main_thread_frame() -> str:
    """Where the main thread is: its innermost Python frame, as 'folder/file.py:LINE function'."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{'/'.join(Path(code.co_filename).parts[-2:])}:{frame.f_lineno} {code.co_name}"


def write_stacks(header: str) -> str:
    """A local file with `header`, every thread's Python stack, the flight recorder's view of the
    collectives and py-spy's native frames where py-spy is on PATH; returns its path."""
    fd, path = tempfile.mkstemp(prefix="vitforge-hang-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"{header}\n== Python stacks of every thread (most recent call first)\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write(f"\n== collectives (torch.distributed flight recorder, pending ones)\n{_pending_collectives()}\n")
        f.write(f"\n== native frames (py-spy dump --native)\n{_native_stacks()}\n")
    return path


def _pending_collectives() -> str:
    try:  # not public API: what the flight recorder holds, where this torch has one
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = json.loads(_dump_fr_trace_json(True, True))
    except Exception as e:  # a missing recorder only means less evidence
        return f"(none: {type(e).__name__}: {e})"
    lines = [
        f"{e.get('profiling_name')} #{e.get('collective_seq_id')} {e.get('state')} "
        f"group {e.get('process_group')} sizes {e.get('input_sizes')}"
        for e in trace.get("entries", [])
        if not e.get("retired")
    ]
    return "\n".join([*lines, f"groups: {json.dumps(trace.get('pg_status', {}), sort_keys=True)}"])


def _native_stacks() -> str:
    spy = shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not on PATH)"
    if sys.platform.startswith("linux"):  # where Yama allows only ancestors to trace, let py-spy in
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)
    try:
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=SPY_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(py-spy failed: {e})"
    return done.stdout + done.stderr
