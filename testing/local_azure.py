"""Azurite, Microsoft's Azure Blob emulator (from npm), on 127.0.0.1, for the tests, the benchmarks
and the demo. `make azurite` installs it under .venv/azurite; one on PATH also does.

What it does not show: a conditional create on an existing blob is answered 409 (Azure: 409 or
412; the store maps both to PreconditionFailed), and it accepts any API version only with
--skipApiVersionCheck. Telemetry is off."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from vitforge.core import free_port

from .managed import start_process, stop_process, wait_until_ready

# The emulator's well-known development account (published by Microsoft, not a secret).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
INSTALL_HINT = "install Azurite with `make azurite` (npm install --prefix .venv/azurite azurite@3.35)"


@dataclass
class LocalAzure:
    endpoint: str  # http://127.0.0.1:PORT/devstoreaccount1
    env: dict  # AZURE_STORAGE_CONNECTION_STRING pointing at it
    process: subprocess.Popen = field(repr=False)
    log_path: str = ""

    def client(self):
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.env["AZURE_STORAGE_CONNECTION_STRING"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        stop_process(self.process)  # node's whole group


def azurite_binary() -> str:
    venv = os.path.dirname(os.path.dirname(sys.executable))
    local = os.path.join(venv, "azurite", "node_modules", ".bin", "azurite-blob")
    found = local if os.access(local, os.X_OK) else shutil.which("azurite-blob")
    if found is None:
        raise RuntimeError(f"azurite-blob is missing (looked in {os.path.dirname(local)} and PATH): {INSTALL_HINT}")
    return found


def dev_connection_string(endpoint: str) -> str:
    return f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};BlobEndpoint={endpoint};"


def start_local_azure(data_dir: str, timeout: float = 30, port: int | None = None) -> LocalAzure:
    """Start azurite-blob on 127.0.0.1 (a free port, or `port` to come back where a stopped one was),
    keeping its blobs in `data_dir`."""
    os.makedirs(data_dir, exist_ok=True)
    port = port or free_port()
    cmd = [
        azurite_binary(),
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--location",
        data_dir,
        "--skipApiVersionCheck",
        "--disableTelemetry",
        "--silent",
    ]
    log_path = os.path.join(data_dir, "azurite.log")
    process = start_process(cmd, log_path)
    endpoint = f"http://127.0.0.1:{port}/{DEV_ACCOUNT}"
    server = LocalAzure(
        endpoint, {"AZURE_STORAGE_CONNECTION_STRING": dev_connection_string(endpoint)}, process, log_path
    )

    def listens() -> bool:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True

    wait_until_ready(process, listens, f"azurite-blob on 127.0.0.1:{port}", log_path, timeout)
    return server
