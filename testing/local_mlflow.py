"""A real MLflow tracking server (`mlflow server`) on 127.0.0.1, for the tests and the benchmarks.
`make mlflow-server` installs it in .venv/mlflow-server, a venv of its own: the full `mlflow` package
pins pyarrow below the project's, and the project's venv holds only the client (mlflow-skinny).

Runs and metrics in a sqlite file, artifacts in a folder behind the server (`--artifacts-destination`:
clients upload over HTTP, as they do to a remote server). One worker, no job runner, no telemetry:
2 processes, about 550 MB. `mlflow` starts uvicorn as a child that outlives a kill of its parent,
so `stop` ends the whole process group; `start` brings a stopped server back on the same port with
its runs."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field

from vitforge.core import free_port

from .managed import start_process, stop_process, wait_until_ready

INSTALL_HINT = "install it with `make mlflow-server` (a venv of its own: pip install -r ci/mlflow-server.txt)"
QUIET = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@dataclass
class LocalMLflow:
    data_dir: str
    port: int
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        """The client's environment: MLFLOW_TRACKING_URI pointing here."""
        return {"MLFLOW_TRACKING_URI": self.uri}

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "mlflow-server.log")

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.uri)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60) -> None:
        """Start the server (again, after `stop`: the same port and runs); return once GET /health answers."""
        cmd = [
            mlflow_server_binary(),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.data_dir}/mlflow.db",
            "--artifacts-destination",
            os.path.join(self.data_dir, "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        self.process = start_process(cmd, self.log_path, env={**os.environ, **QUIET})

        def healthy() -> bool:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200

        wait_until_ready(self.process, healthy, f"mlflow server at {self.uri}", self.log_path, timeout, poll_s=0.2)

    def stop(self, kill: bool = False) -> None:
        """End the server and its uvicorn child (SIGKILL with `kill`: a crash, nothing flushed)."""
        if self.process is not None:
            stop_process(self.process, kill)


def mlflow_server_binary() -> str:
    venv = os.path.dirname(os.path.dirname(sys.executable))
    binary = os.path.join(venv, "mlflow-server", "bin", "mlflow")
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"the MLflow server is missing ({binary}): {INSTALL_HINT}")
    return binary


def start_local_mlflow(data_dir: str, timeout: float = 60) -> LocalMLflow:
    """`mlflow server` on 127.0.0.1 and a free port, keeping its runs in `data_dir`/mlflow.db and
    its artifacts in `data_dir`/artifacts, answering GET /health."""
    os.makedirs(data_dir, exist_ok=True)
    server = LocalMLflow(data_dir, free_port())
    server.start(timeout)
    return server
