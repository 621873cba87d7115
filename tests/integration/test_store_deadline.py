"""Every object-store call is bounded: per-attempt connect/read timeouts and a total deadline per
operation, each failed attempt logged, and exit 3 naming the endpoint once the deadline passes.

The endpoint under test is a local listener that accepts connections and never answers: the
failure that used to hang a command silently for 10+ minutes."""

from __future__ import annotations

import re
import socket
import threading

import pytest

from common.checks import SECRET
from common.cli import REPO, vitforge

# Test-sized bounds; `timeout=` on each command is the "does not hang" bound, far above them.
# A deadline of several attempts' timeouts: on a loaded machine one 1 s attempt can take 2-3 s of
# wall time, and the test reads the log of the attempts before the last.
LIMITS = {"VITFORGE_STORE_CONNECT_TIMEOUT_S": "1", "VITFORGE_STORE_READ_TIMEOUT_S": "1",
          "VITFORGE_STORE_DEADLINE_S": "6"}


@pytest.fixture
def silent_endpoint():
    """http://127.0.0.1:PORT that accepts every connection, holds it open and never sends a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept_forever():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # the listener was closed: the test is over
                return

    threading.Thread(target=accept_forever, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for connection in held:
        connection.close()


def silent_env(endpoint: str) -> dict:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", **LIMITS}


@pytest.mark.parametrize("command", [
    ["shard", "verify", "s3://silent-bucket/ds"],  # the sharder's store (S3Store, boto3)
    ["shard", "s3://silent-bucket/src", "{tmp}/out", "--workers", "1"],  # the sharder's sources (fsspec / s3fs)
    ["ckpt", "list", "s3://silent-bucket/runs/r"],  # the trainer's checkpoint store
    # a local manifest of images in the store: a dead store is not every image's fault (no rejects, no exit 0)
    ["shard", "{tmp}/images.csv", "{tmp}/out", "--root", "s3://silent-bucket/", "--workers", "1"],
], ids=["store", "sources", "checkpoints", "manifest-images"])
@pytest.mark.slow
def test_a_silent_endpoint_fails_with_exit_3_naming_it(silent_endpoint, tmp_path, command):
    (tmp_path / "images.csv").write_text("path,label\n" + "".join(
        f"s3://silent-bucket/img/{i}.jpg,c{i % 2}\n" for i in range(3)))
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    result = vitforge(*args, env=silent_env(silent_endpoint), check=False, timeout=45)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    last = [line for line in result.stderr.splitlines() if line.startswith("vitforge:")]
    assert len(last) == 1 and "Traceback" not in output, output
    assert silent_endpoint in last[0] and "s3://silent-bucket/" in last[0], last[0]
    assert "VITFORGE_STORE_DEADLINE_S" in last[0], last[0]
    # every failed attempt but the last is logged: operation, attempt n/N, endpoint, error class
    retries = [line for line in result.stderr.splitlines() if re.search(r"attempt \d+/\d+ failed", line)]
    assert retries and all(silent_endpoint in line and "Timeout" in line for line in retries), output
    assert SECRET not in output
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_default_bounds_suit_a_real_cloud_and_are_documented(monkeypatch):
    from vitforge.core.retry import store_limits

    for name in [*LIMITS, "AWS_MAX_ATTEMPTS"]:
        monkeypatch.delenv(name, raising=False)
    limits = store_limits()
    assert (limits.connect_timeout_s, limits.read_timeout_s, limits.deadline_s, limits.attempts) == (10, 60, 180, 5)
    # a dead endpoint fails within 5 minutes: the deadline, plus the one attempt under way when it passes
    assert limits.deadline_s + limits.connect_timeout_s + limits.read_timeout_s <= 300
    readme = (REPO / "README.md").read_text()
    for name, default in [("VITFORGE_STORE_CONNECT_TIMEOUT_S", 10), ("VITFORGE_STORE_READ_TIMEOUT_S", 60),
                          ("VITFORGE_STORE_DEADLINE_S", 180)]:
        assert re.search(rf"`{name}` \(default {default}\)", readme), name


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_bound_is_a_usage_error_naming_the_variable(monkeypatch, value):
    from vitforge.core import UsageError
    from vitforge.core.retry import store_limits

    monkeypatch.setenv("VITFORGE_STORE_DEADLINE_S", value)
    with pytest.raises(UsageError, match=f"VITFORGE_STORE_DEADLINE_S={value}"):
        store_limits()
