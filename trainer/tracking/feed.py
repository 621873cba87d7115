"""The feed: one thread on rank 0 that tails metrics.jsonl into every tracker (sink.py's protocol),
keeping each one's delivered mark in the run's tracking.json (the package's docstring says how)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from vitforge.core import masked

from ..run_store import LEASE, RunStore
from .sink import Sink
from .system import SystemFigures

TRACKING = "tracking.json"
POLL_S = 1.0
SAVE_EVERY_S = 3.0
CLOSE_TIMEOUT_S = 30.0
RETRY_S = (2.0, 60.0)  # first and longest wait before trying an unreachable tracker again
BATCH_ROWS = 50  # rows per request (about 20 metrics each: MLflow takes 1000 per log_batch)
READ_BYTES = 1 << 20
REPORTS = (".md", ".json", ".png")  # report files of the metrics folder, uploaded with metrics.jsonl
SECRETS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY", "DATABRICKS_TOKEN")
# urllib3 warns on every failed attempt ('Retrying ...'): an outage would cost a warning per request.
RETRY_LOGGER = "urllib3.connectionpool"
log = logging.getLogger("vitforge.tracking")


@dataclass
class Tracker:
    """One tracker as the feed sees it: where it is in metrics.jsonl and what it holds."""

    sink: Sink
    opened: bool = False
    offset: int = 0  # bytes of metrics.jsonl read
    step: int = -1  # the step of the last row read, and how many rows of that step were read
    step_rows: int = 0
    last_step: int = -1  # the delivered mark: every row up to the `rows_at_last_step`-th of `last_step`
    rows_at_last_step: int = 0
    rollback: int | None = None  # resumed_from_step, until a row carries it
    down: bool = False
    retry_at: float = 0.0
    wait_s: float = RETRY_S[0]
    saved: tuple = ()  # the mark tracking.json has
    refused: str = ""  # the cause of the last batch the tracker refused for good (logged once)

    def record(self) -> dict:
        return {**self.sink.record(), "last_step": self.last_step, "rows_at_last_step": self.rows_at_last_step}


@dataclass
class RowBatch:
    """The rows one request sends, and where their tracker is in metrics.jsonl once they are sent."""

    rows: list[tuple[int, dict]] = field(default_factory=list)
    offset: int = 0
    step: int = -1
    step_rows: int = 0
    mark: tuple[int, int] = (-1, 0)
    carried_rollback: bool = False


class TrackingFeed:
    """The thread that tails metrics.jsonl into the trackers; `close(finished)` ends it. One thread
    for every tracker: one that hangs delays the others by its client's bounded timeout, never a step.
    Per tracker a Tracker (a few numbers); per poll at most READ_BYTES of rows, dropped after it."""

    def __init__(
        self, sinks: list, run_store: RunStore | None, metrics_path: str, resumed_from: int | None, config: dict
    ):
        self.trackers = [Tracker(sink, rollback=resumed_from) for sink in sinks]
        self.run_store, self.path, self.config = run_store, metrics_path, config
        self.folder = os.path.dirname(metrics_path)
        self.live_after = resumed_from or 0  # rows above this step are written by this process
        self.stored: dict | None = None if run_store is not None else {}
        self.last_save = 0.0
        self.save_failed = False
        self.skipped = 0  # the end of the last line of metrics.jsonl that was not a row
        self.finished = False
        self.system = SystemFigures()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vitforge-tracking", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, finished: bool) -> None:
        """Send what is left, and at the end of a finished run the report files, within
        CLOSE_TIMEOUT_S; never raises. What could not be sent stays in metrics.jsonl for the next start."""
        self.finished = finished
        self._closing.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            names = ", ".join(t.sink.name for t in self.trackers)
            log.warning(
                "tracking: %s did not take the last rows within %.0f s; they stay in %s and go at the next start",
                names,
                CLOSE_TIMEOUT_S,
                self.path,
            )

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        # Only this thread's records: the training's own requests (boto3 shares urllib3) still warn.
        # botocore logs its retries itself, so an S3 store's outage stays visible either way.
        ident = threading.get_ident()

        def others(record: logging.LogRecord) -> bool:
            return record.thread != ident

        quiet = logging.getLogger(RETRY_LOGGER)
        quiet.addFilter(others)
        try:
            self._feed()
        finally:
            quiet.removeFilter(others)

    def _feed(self) -> None:
        self.system.start()
        while not self._closing.wait(POLL_S):
            self._poll(closing=False)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S - 2
        self._poll(closing=True, deadline=deadline)
        self._save(force=True)  # before the uploads, which may overrun the close
        for tracker in self.trackers:
            if not tracker.opened or tracker.down:
                continue
            try:
                if self.finished:
                    tracker.sink.upload(self._reports())
                tracker.sink.finish(self.finished)
            except Exception as e:
                log.warning("tracking: could not end the %s run: %s", tracker.sink.name, _safe(e))
        self._save(force=True)

    def _poll(self, closing: bool, deadline: float = float("inf")) -> None:
        self.system.forget()
        for tracker in self.trackers:
            if closing or time.monotonic() >= tracker.retry_at:
                self._pump(tracker, deadline)
        self._save(force=False)

    def _pump(self, tracker: Tracker, deadline: float) -> None:
        """Open the tracker's run if need be, then send it every row it lacks."""
        sent = 0
        try:
            if not tracker.opened:
                self._open(tracker)
            while time.monotonic() < deadline:
                batch = self._read(tracker)
                if batch is None:
                    break
                if batch.rows and self._send(tracker, batch):
                    sent += len(batch.rows)
                tracker.offset, tracker.step, tracker.step_rows = batch.offset, batch.step, batch.step_rows
                tracker.last_step, tracker.rows_at_last_step = batch.mark
                if batch.carried_rollback:
                    tracker.rollback = None
                self._save(force=False)
        except Exception as e:
            if not tracker.down:
                log.warning(
                    "tracking: %s is unreachable (%s); its rows stay in %s and are sent when it answers "
                    "again (retrying with backoff); training goes on",
                    tracker.sink.name,
                    _safe(e),
                    self.path,
                )
            tracker.down = True
            tracker.retry_at = time.monotonic() + tracker.wait_s
            tracker.wait_s = min(tracker.wait_s * 2, RETRY_S[1])
            return
        if tracker.down:
            log.info("tracking: %s answers again: sent the %d rows it missed", tracker.sink.name, sent)
        tracker.down, tracker.wait_s = False, RETRY_S[0]

    def _send(self, tracker: Tracker, batch: RowBatch) -> bool:
        """Send `batch`; False when the tracker refused it for good (it is dropped: retrying the same
        rows would stall every row after them). Raises when the tracker may take it later."""
        try:
            tracker.sink.send(batch.rows)
            return True
        except Exception as e:
            if not tracker.sink.permanent(e):
                raise
            cause = _safe(e)
        if cause != tracker.refused:
            log.error(
                "tracking: %s refused the rows of steps %d-%d for good (%s); they are not sent to it, "
                "the rows after them are",
                tracker.sink.name,
                batch.rows[0][0],
                batch.rows[-1][0],
                cause,
            )
        tracker.refused = cause
        return False

    def _open(self, tracker: Tracker) -> None:
        if self.stored is None:
            try:
                self.stored = json.loads(self.run_store.get_bytes(TRACKING))
            except FileNotFoundError:
                self.stored = {}
        stored = self.stored.get(tracker.sink.key)
        sink = tracker.sink
        if stored and sink.open(stored, self.config):
            tracker.last_step, tracker.rows_at_last_step = max(
                (stored["last_step"], stored["rows_at_last_step"]), sink.held()
            )
            log.info(
                "tracking: continuing %s run %s (%s) after step %d",
                sink.name,
                sink.run_id,
                sink.place,
                tracker.last_step,
            )
        else:
            if stored:
                log.warning(
                    "tracking: the %s run %s of this run is gone; starting a new one with every row of %s",
                    sink.name,
                    stored.get("run_id"),
                    self.path,
                )
            sink.create(self.config, lambda: self._save(force=True, extra=tracker))
            log.info("tracking: started %s run %s (%s)", sink.name, sink.run_id, sink.place)
        tracker.opened = True
        tracker.saved = ()
        self._save(force=True)

    def _read(self, tracker: Tracker) -> RowBatch | None:
        """The next rows `tracker` lacks (at most BATCH_ROWS), and where it is after them; None when
        it has read every complete line of the file."""
        with open(self.path, "rb") as f:
            f.seek(tracker.offset)
            data = f.read(READ_BYTES)
            at_end = f.tell() == os.fstat(f.fileno()).st_size
        data = data[: data.rfind(b"\n") + 1]
        if not data:
            return None
        batch = RowBatch(
            offset=tracker.offset,
            step=tracker.step,
            step_rows=tracker.step_rows,
            mark=(tracker.last_step, tracker.rows_at_last_step),
        )
        lines = data.splitlines(keepends=True)
        for n, line in enumerate(lines):
            batch.offset += len(line)
            row = _row(line)
            if row is None:
                if batch.offset > self.skipped:  # the first tracker to read it says so
                    log.warning("tracking: skipped a line of %s that is not a metrics row: %r", self.path, line[:200])
                    self.skipped = batch.offset
                continue
            step = row.pop("step", 0)
            batch.step_rows = batch.step_rows + 1 if step == batch.step else 1
            batch.step = step
            if (step, batch.step_rows) <= batch.mark:
                continue  # a replay of a step the tracker holds
            values = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            if tracker.rollback is not None and step > tracker.rollback and not batch.carried_rollback:
                values["resumed_from_step"] = tracker.rollback
                batch.carried_rollback = True
            if at_end and n == len(lines) - 1 and step > self.live_after:
                values.update(self.system.sample())
            batch.rows.append((step, values))
            batch.mark = (step, batch.step_rows)
            if len(batch.rows) >= BATCH_ROWS:
                break
        return batch

    def _save(self, force: bool, extra: Tracker | None = None) -> None:
        """tracking.json: every tracker's run id and mark (SAVE_EVERY_S apart unless `force`);
        `extra`: a tracker whose run exists but is not opened yet (its run id must be kept now)."""
        if self.run_store is None or self.stored is None:
            return
        kept = [t for t in self.trackers if t.opened or t is extra]
        changed = any(t.saved != (t.sink.record().get("run_id"), t.last_step, t.rows_at_last_step) for t in kept)
        if not changed or (not force and time.monotonic() - self.last_save < SAVE_EVERY_S):
            return
        state = {**self.stored, **{t.sink.key: t.record() for t in kept}}
        try:
            self.run_store.put_bytes(TRACKING, json.dumps(state, indent=1, sort_keys=True).encode())
        except Exception as e:
            if not self.save_failed:
                log.warning("tracking: could not write %s: %s", self.run_store.object_url(TRACKING), _safe(e))
            self.save_failed = True
            return
        self.stored, self.last_save, self.save_failed = state, time.monotonic(), False
        for t in kept:
            t.saved = (t.sink.record().get("run_id"), t.last_step, t.rows_at_last_step)

    def _reports(self) -> list[str]:
        """metrics.jsonl and the report files beside it (not the run store's own objects when the
        metrics folder is the run folder, nor the TensorBoard or W&B folders)."""
        names = sorted(n for n in os.listdir(self.folder) if n.endswith(REPORTS) and n not in (LEASE, TRACKING))
        paths = [self.path] + [os.path.join(self.folder, n) for n in names]
        return [p for p in paths if os.path.isfile(p)]


def _row(line: bytes) -> dict | None:
    """A line of metrics.jsonl as a row; None when it is not one (a torn or foreign line)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step", 0), int) else None


def _safe(error: Exception) -> str:
    """An error's first line for the log, without credentials: URL user info and the values of
    the trackers' secret environment variables are masked."""
    text = (str(error).strip().splitlines() or [""])[0][:400]
    text = masked(text)
    for name in SECRETS:
        if os.environ.get(name):
            text = text.replace(os.environ[name], "***")
    return f"{type(error).__name__}: {text}"
