"""Experiment trackers (MLflow, W&B): one tracker run per vitforge run across every requeue, fed from
metrics.jsonl by a thread on rank 0, never in the step's way.

metrics.jsonl is the buffer. A background thread tails it and sends each tracker the rows it does
not hold yet; a tracker that does not answer costs one warning, its rows wait on disk and go when it
answers again (one info line says how many). Each tracker's run id and delivered mark (the last
step it holds, and how many of that step's rows: a step has a log row and may have an evaluation
row) live in the run's store as tracking.json, so a requeued or relaunched job continues the same
tracker run. A resumed run replays the steps after its checkpoint with the very same values (resume
is exact): rows at or below the mark are not sent again, so the tracker holds every step once, and
the first new row carries `resumed_from_step`, the rollback. Rows a dead tracker never got are
still in metrics.jsonl (the store keeps it with each checkpoint) and go at the next start.
On opening an existing MLflow run the mark is raised to what the server already holds, so that rows
delivered after the last save (a kill -9, an OOM, a close that overran) are not sent twice.

A tracker that refuses a batch for good (an invalid name or value, a deleted run: a client error that
no retry mends) costs one error per cause: the batch is dropped and the rows after it keep flowing.
A line of metrics.jsonl that is not a row is skipped with one warning.

Rank 0 logs the resolved config as parameters (once: MLflow's are immutable), every metrics row,
system figures with each row that is sent as it is written (CPU, host memory; GPU utilisation and
memory through NVML when pynvml is importable), and at the end of a finished run its report files
as artifacts; in names MLflow refuses, `_` replaces every character but letters, digits and `_-.:/ `.
Settings come from the recipe (tracking.*) or the trackers' own environment variables. No secret is
ever written: tracking.json holds run ids and steps, parameters come from the config (whose validator
refuses credentials in a URI), and error messages are scrubbed.

Cost: rank 0 only, one thread; per tracker a file offset and its mark; a poll reads at most
READ_BYTES of new rows and holds none after it (O(1) memory per row); tracking.json (a few hundred
bytes) is written when a tracker run starts, once the last rows are sent at close, and in between
after rows are delivered, at most every SAVE_EVERY_S: one small PUT per few seconds at most.
Other ranks hold nothing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

from .config import Config, ConfigError, MLflowTracking, TrackingConfig, WandbTracking
from .run_store import LEASE, RunStore

TRACKING = "tracking.json"
POLL_S = 1.0
SAVE_EVERY_S = 3.0
CLOSE_TIMEOUT_S = 30.0
RETRY_S = (2.0, 60.0)  # first and longest wait before trying an unreachable tracker again
BATCH_ROWS = 50  # rows per request (about 20 metrics each: MLflow takes 1000 per log_batch)
READ_BYTES = 1 << 20
REPORTS = (".md", ".json", ".png")  # report files of the metrics folder, uploaded with metrics.jsonl
SECRETS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY", "DATABRICKS_TOKEN")
# A dead MLflow server blocks one client call 247 s with the client's defaults (7 retries, backoff 2,
# 120 s timeout); this thread has its own retries, so each call gives up within about half a minute.
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# Ending a run, the client prints its URL to stdout: the tracking URI with any password in it, and
# a line in the CLI's stdout, whose last line is the run's result.
MLFLOW_QUIET = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
MLFLOW_BAD_KEY = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a metric or parameter name
# urllib3 warns on every failed attempt ('Retrying ...'): an outage would cost a warning per request.
RETRY_LOGGER = "urllib3.connectionpool"
log = logging.getLogger("vitforge.tracking")


def trackers_on(tracking: TrackingConfig) -> list[str]:
    """The trackers asked for; each is the name of its client module and of its pip extra."""
    return [name for name in ("mlflow", "wandb") if getattr(tracking, name) is not None]


def check_trackers(tracking: TrackingConfig, warm: bool = False) -> None:
    """Every rank, before anything is built: the same ConfigError everywhere when a tracker's client
    is missing or MLflow has no server to talk to (found, not imported: `import mlflow` takes seconds).
    `warm` (rank 0): import the clients in a background thread meanwhile, so that the import overlaps
    the model's build instead of delaying the feed's first rows (and a preempted job's exit)."""
    names = trackers_on(tracking)
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"tracking.{name} is on but its client is not installed: "
                              f"pip install 'vitforge[{name}]'")
    if tracking.mlflow is not None and not (tracking.mlflow.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        raise ConfigError("tracking.mlflow is on but names no server: set tracking.mlflow.uri or "
                          "MLFLOW_TRACKING_URI (e.g. http://mlflow.example:5000)")
    if warm and names:
        threading.Thread(target=_import, args=(names,), name="vitforge-tracking-import", daemon=True).start()


def _import(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # the feed imports it again, and says why it cannot
            return


def start_tracking(cfg: Config, run_store: RunStore, metrics_path: str,
                   resumed_from: int | None) -> TrackingFeed | None:
    """Rank 0: start feeding the trackers the run's config and metrics_path's rows; None when no
    tracker is on. `resumed_from`: the step restored from a checkpoint (None: a fresh run).
    Returns at once: the store and the trackers are only ever touched by the feed's thread."""
    check_trackers(cfg.tracking)
    sinks = []
    if cfg.tracking.mlflow is not None:
        sinks.append(MLflowSink(cfg.tracking.mlflow, cfg.checkpoint.run))
    if cfg.tracking.wandb is not None:
        sinks.append(WandbSink(cfg.tracking.wandb, cfg.checkpoint.run, os.path.dirname(metrics_path)))
    if not sinks:
        return None
    # Without checkpoints (checkpoint.save false) nothing resumes: no tracking.json either.
    feed = TrackingFeed(sinks, run_store if cfg.checkpoint.save else None, metrics_path, resumed_from,
                        cfg.model_dump(mode="json"))
    feed.start()
    return feed


# -- the feed ------------------------------------------------------------------------------------
@dataclass
class Tracker:
    """One tracker as the feed sees it: where it is in metrics.jsonl and what it holds."""
    sink: MLflowSink | WandbSink
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
class Batch:
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

    def __init__(self, sinks: list, run_store: RunStore | None, metrics_path: str, resumed_from: int | None,
                 config: dict):
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
            log.warning("tracking: %s did not take the last rows within %.0f s; they stay in %s and go at the "
                        "next start", names, CLOSE_TIMEOUT_S, self.path)

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
                log.warning("tracking: %s is unreachable (%s); its rows stay in %s and are sent when it answers "
                            "again (retrying with backoff); training goes on", tracker.sink.name, _safe(e), self.path)
            tracker.down = True
            tracker.retry_at = time.monotonic() + tracker.wait_s
            tracker.wait_s = min(tracker.wait_s * 2, RETRY_S[1])
            return
        if tracker.down:
            log.info("tracking: %s answers again: sent the %d rows it missed", tracker.sink.name, sent)
        tracker.down, tracker.wait_s = False, RETRY_S[0]

    def _send(self, tracker: Tracker, batch: Batch) -> bool:
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
            log.error("tracking: %s refused the rows of steps %d-%d for good (%s); they are not sent to it, "
                      "the rows after them are", tracker.sink.name, batch.rows[0][0], batch.rows[-1][0], cause)
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
            tracker.last_step, tracker.rows_at_last_step = max((stored["last_step"], stored["rows_at_last_step"]),
                                                               sink.held())
            log.info("tracking: continuing %s run %s (%s) after step %d", sink.name, sink.run_id, sink.place,
                     tracker.last_step)
        else:
            if stored:
                log.warning("tracking: the %s run %s of this run is gone; starting a new one with every row of %s",
                            sink.name, stored.get("run_id"), self.path)
            sink.create(self.config, lambda: self._save(force=True, extra=tracker))
            log.info("tracking: started %s run %s (%s)", sink.name, sink.run_id, sink.place)
        tracker.opened = True
        tracker.saved = ()
        self._save(force=True)

    def _read(self, tracker: Tracker) -> Batch | None:
        """The next rows `tracker` lacks (at most BATCH_ROWS), and where it is after them; None when
        it has read every complete line of the file."""
        with open(self.path, "rb") as f:
            f.seek(tracker.offset)
            data = f.read(READ_BYTES)
            at_end = f.tell() == os.fstat(f.fileno()).st_size
        data = data[:data.rfind(b"\n") + 1]
        if not data:
            return None
        batch = Batch(offset=tracker.offset, step=tracker.step, step_rows=tracker.step_rows,
                      mark=(tracker.last_step, tracker.rows_at_last_step))
        lines = data.splitlines(keepends=True)
        for n, line in enumerate(lines):
            batch.offset += len(line)
            row = _row(line)
            if row is None:
                if batch.offset > self.skipped:  # the first tracker to read it says so
                    log.warning("tracking: skipped a line of %s that is not a metrics row: %r", self.path,
                                line[:200])
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


# -- the trackers --------------------------------------------------------------------------------
class MLflowSink:
    """An MLflow run through MlflowClient (the tracking server's REST API)."""

    name, key = "MLflow", "mlflow"

    def __init__(self, settings: MLflowTracking, run: str):
        self.uri = settings.uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.experiment = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "vitforge"
        self.run_name = settings.run_name or run
        self.place = f"experiment {self.experiment}"
        self.client = None
        self.run_id: str | None = None
        self.params: list = []  # parameters of a run created by this process, until they are logged
        for name, value in MLFLOW_BOUNDS.items():  # unless the user bounded them otherwise
            os.environ.setdefault(name, value)
        os.environ.update(MLFLOW_QUIET)

    def record(self) -> dict:
        return {"run_id": self.run_id}

    def _client(self):
        if self.client is None:
            from mlflow import MlflowClient

            self.client = MlflowClient(self.uri)
        return self.client

    def open(self, stored: dict, config: dict) -> bool:
        """Continue the stored run; False when the server does not have it."""
        from mlflow.exceptions import MlflowException

        try:
            self._client().get_run(stored["run_id"])
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        self.run_id = stored["run_id"]
        self.client.update_run(self.run_id, status="RUNNING")
        self._log_params()
        return True

    def held(self) -> tuple[int, int]:
        """The delivered mark the server proves: (S, 1), S the highest step of the run's latest metrics
        (one per name). A batch is logged by requests of whole rows, in order, so every row before a
        held one is held, the first row of step S too. A later row of step S (an evaluation) may be
        held or not: it is sent again, so a step's evaluation may show twice but no row is lost."""
        metrics = self.client.get_run(self.run_id).data.to_proto().metrics
        return (max(m.step for m in metrics), 1) if metrics else (-1, 0)

    def create(self, config: dict, keep) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        client = self._client()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(self.experiment)
            except MlflowException as e:  # created meanwhile by another run
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment_id = client.get_experiment_by_name(self.experiment).experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        # Parameters are immutable: logged once, for the run this process created (a retry after a
        # failure here finds the run stored and logs them then). Values up to 6000 characters.
        self.params = [Param(mlflow_key(k), v[:6000]) for k, v in flat(config).items()]
        keep()
        self._log_params()

    def _log_params(self) -> None:
        while self.params:
            self.client.log_batch(self.run_id, params=self.params[:100])
            del self.params[:100]

    def send(self, rows: list[tuple[int, dict]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for step, values in rows:  # requests of whole rows (see held), 1000 metrics at most
            row = [Metric(mlflow_key(k), float(v), now, step) for k, v in values.items()]
            if metrics and len(metrics) + len(row) > 1000:
                self.client.log_batch(self.run_id, metrics=metrics)
                metrics = []
            metrics += row
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    @staticmethod
    def permanent(error: Exception) -> bool:
        """A client error (HTTP 4xx) other than throttling, or a refused login (the user mends that: the
        rows wait in metrics.jsonl); an unreachable server is a 5xx (INTERNAL_ERROR) here."""
        from mlflow.exceptions import MlflowException

        return isinstance(error, MlflowException) and 400 <= error.get_http_status_code() < 500 and \
            error.get_http_status_code() not in (401, 403, 429)

    def upload(self, paths: list[str]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path)

    def finish(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


class WandbSink:
    """A W&B run, always started with the stored (or a new) id and resume="allow"."""

    name, key = "W&B", "wandb"

    def __init__(self, settings: WandbTracking, run: str, folder: str):
        self.settings, self.run_name, self.folder = settings, settings.run_name or run, folder
        self.project = settings.project or os.environ.get("WANDB_PROJECT") or "vitforge"
        self.place = f"project {self.project}"
        self.run = None
        self.run_id: str | None = None

    def record(self) -> dict:
        return {"run_id": self.run_id}

    def open(self, stored: dict, config: dict) -> bool:
        self.run_id = stored["run_id"]
        self._init(config)
        return True

    def create(self, config: dict, keep) -> None:
        self.run_id = uuid.uuid4().hex[:16]  # W&B's own ids are 8 characters of [a-z0-9]
        keep()  # before the run exists: a job killed during init still comes back to this id
        self._init(config)

    def _init(self, config: dict) -> None:
        import wandb

        s = self.settings
        # console off: W&B would otherwise wrap this process's stdout and stderr; its own system
        # monitor is off too: the feed sends the system figures with the rows.
        self.run = wandb.init(id=self.run_id, resume="allow", project=self.project, entity=s.entity, mode=s.mode,
                              name=self.run_name,
                              dir=None if os.environ.get("WANDB_DIR") else self.folder,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run.config.update(config, allow_val_change=True)

    def held(self) -> tuple[int, int]:
        return (-1, 0)  # the stored mark only: an offline run has no server to ask

    def send(self, rows: list[tuple[int, dict]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    @staticmethod
    def permanent(error: Exception) -> bool:
        """Values W&B cannot log, or a misuse; its network errors are retried by its own service."""
        from wandb.errors import UsageError

        return isinstance(error, (TypeError, ValueError, UsageError))

    def upload(self, paths: list[str]) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run_id}-report", type="run-report")
        for path in paths:
            artifact.add_file(path)
        self.run.log_artifact(artifact)

    def finish(self, finished: bool) -> None:
        if not finished:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if finished else 1)


# -- helpers -------------------------------------------------------------------------------------
class SystemFigures:
    """CPU and host memory (psutil), GPU utilisation and memory (NVML, when pynvml is importable and
    sees a GPU) of rank 0's node: sampled at most once per poll, under MLflow's system metric names."""

    def __init__(self):
        self.nvml = None
        self.gpus = 0
        self.cached: dict | None = None

    def start(self) -> None:
        import psutil

        psutil.cpu_percent(None)  # the first call starts the interval the next one measures
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.gpus = pynvml, pynvml.nvmlDeviceGetCount()
        except Exception:  # no pynvml, no driver, no GPU: CPU figures only
            self.nvml = None

    def forget(self) -> None:
        self.cached = None

    def sample(self) -> dict:
        if self.cached is None:
            import psutil

            memory = psutil.virtual_memory()
            figures = {"system/cpu_utilization_percentage": psutil.cpu_percent(None),
                       "system/system_memory_usage_percentage": memory.percent,
                       "system/system_memory_usage_megabytes": memory.used / 2**20}
            for i in range(self.gpus):
                gpu = self.nvml.nvmlDeviceGetHandleByIndex(i)
                figures[f"system/gpu_{i}_utilization_percentage"] = self.nvml.nvmlDeviceGetUtilizationRates(gpu).gpu
                figures[f"system/gpu_{i}_memory_usage_megabytes"] = self.nvml.nvmlDeviceGetMemoryInfo(gpu).used / 2**20
            self.cached = figures
        return self.cached


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"steps": 10}} -> {"train.steps": "10"}: the config as tracker parameters."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def mlflow_key(name: str) -> str:
    """A metric or parameter name as MLflow takes it: e.g. `eval_fewshot_in1k@224_5shot` becomes
    `eval_fewshot_in1k_224_5shot`."""
    return MLFLOW_BAD_KEY.sub("_", name)


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
    text = re.sub(r"(\w+://)[^/\s@]*@", r"\1***@", text)
    for name in SECRETS:
        if os.environ.get(name):
            text = text.replace(os.environ[name], "***")
    return f"{type(error).__name__}: {text}"
