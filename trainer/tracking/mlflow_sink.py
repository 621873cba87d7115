"""MLflow as a tracker: one MLflow run per vitforge run, through MlflowClient (the tracking
server's REST API); `mlflow` (the client, `vitforge[mlflow]`) is imported when the feed first uses it."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from ..output_config import MLflowTracking

# A dead MLflow server blocks one client call 247 s with the client's defaults (7 retries, backoff 2,
# 120 s timeout); this thread has its own retries, so each call gives up within about half a minute.
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# Ending a run, the client prints its URL to stdout: the tracking URI with any password in it, and
# a line in the CLI's stdout, whose last line is the run's result.
MLFLOW_QUIET = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
MLFLOW_BAD_KEY = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a metric or parameter name


class MLflowSink:
    """An MLflow run through MlflowClient (the tracking server's REST API)."""

    name, key = "MLflow", "mlflow"

    def __init__(self, settings: MLflowTracking, run: str, folder: str | None = None):  # folder: W&B's, not MLflow's
        self.uri = settings.uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.experiment = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "vitforge"
        self.run_name = settings.run_name or run
        self.place = f"experiment {self.experiment}"
        self.client: Any = None  # an MlflowClient, made on first use
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
        metrics: list = []
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

        return (
            isinstance(error, MlflowException)
            and 400 <= error.get_http_status_code() < 500
            and error.get_http_status_code() not in (401, 403, 429)
        )

    def upload(self, paths: list[str]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path)

    def finish(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


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
