"""Sharding to and from s3:// on a real S3 server (SeaweedFS on 127.0.0.1), with injected faults."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.checks import SECRET, tree_bytes
from common.cli import REPO, vitforge


def download_prefix(client, bucket: str, prefix: str, dest: Path) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            target = dest / obj["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())


def upload_folder(client, bucket: str, folder: Path, prefix: str) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(folder)}", Body=path.read_bytes())


def test_shard_to_s3_through_faults_equals_local_and_verifies(small_corpus, tmp_path, s3_server, bucket, faulty):
    env, schedule = faulty
    local = tmp_path / "local"
    vitforge("shard", small_corpus, local, "--shard-samples", "16", "--workers", "2")
    url = f"s3://{bucket}/datasets/demo"
    result = vitforge("shard", small_corpus, url, "--shard-samples", "16", "--workers", "2", env=env)
    assert "120 inputs = 120 packed" in result.stdout
    assert sum(schedule.injected.values()) >= 5, schedule.injected
    assert all(schedule.injected.values()), schedule.injected
    copy = tmp_path / "copy"
    download_prefix(s3_server["client"], bucket, "datasets/demo", copy)
    assert tree_bytes(copy) == tree_bytes(local)
    verify = vitforge("shard", "verify", url, "--workers", "2", env=env)
    assert "verified 8 shards, 120 samples: all good" in verify.stdout
    info = vitforge("shard", "info", url, env=env)
    assert "120 in 8 shards" in info.stdout
    for output in (result, verify, info):
        assert SECRET not in output.stdout + output.stderr
    assert not any(SECRET.encode() in data for data in tree_bytes(copy).values())


@pytest.mark.slow
def test_source_in_s3_class_folders_and_manifest(small_corpus, tmp_path, s3_server, bucket, faulty):
    env, schedule = faulty
    upload_folder(s3_server["client"], bucket, small_corpus, "raw/images")
    out = tmp_path / "from_s3"
    result = vitforge("shard", f"s3://{bucket}/raw/images", out, "--shard-samples", "32", "--workers", "2", env=env)
    assert "120 inputs = 120 packed + 0 rejected" in result.stdout
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["classes"] == [f"class_{i:02d}" for i in range(5)]
    assert manifest["class_counts"] == [24] * 5
    # A CSV manifest stored in the bucket, with paths relative to it, one of them missing.
    rows = "path,label\nclass_00/img_00000.jpg,a\nclass_01/img_00000.jpg,b\nclass_01/nope.jpg,b\n"
    s3_server["client"].put_object(Bucket=bucket, Key="raw/images/list.csv", Body=rows.encode())
    result = vitforge("shard", f"s3://{bucket}/raw/images/list.csv", tmp_path / "m", "--workers", "1", env=env)
    assert "3 inputs = 2 packed + 1 rejected" in result.stdout
    reject = json.loads((tmp_path / "m" / "rejects.jsonl").read_text())
    assert reject["source"] == f"s3://{bucket}/raw/images/class_01/nope.jpg" and reject["reason"] == "unreadable"
    assert SECRET not in result.stdout + result.stderr


def test_killed_s3_run_resumes_to_identical_objects(small_corpus, tmp_path, s3_server, bucket):
    env = s3_server["env"]
    reference = tmp_path / "reference"
    vitforge("shard", small_corpus, reference, "--shard-samples", "4", "--workers", "1")
    url = f"s3://{bucket}/killed"
    cmd = [sys.executable, "-m", "vitforge", "shard", str(small_corpus), url, "--shard-samples", "4", "--workers", "1"]
    client = s3_server["client"]

    def records() -> int:
        listing = client.list_objects_v2(Bucket=bucket, Prefix="killed/_work/shards/")
        return listing.get("KeyCount", 0)

    process = subprocess.Popen(cmd, cwd=REPO, env={**__import__("os").environ, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while records() < 5 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert client.list_objects_v2(Bucket=bucket, Prefix="killed/dataset.json").get("KeyCount", 0) == 0
    result = vitforge(*cmd[3:], env=env)
    built = int(result.stdout.split("built ")[1].split(" ")[0])
    assert 0 < built < 30
    copy = tmp_path / "copy"
    download_prefix(client, bucket, "killed", copy)
    assert tree_bytes(copy) == tree_bytes(reference)


def test_unreachable_store_fails_naming_the_url(small_corpus, tmp_path):
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    result = vitforge("shard", small_corpus, "s3://nowhere-bucket/ds", "--workers", "1", env=env, check=False,
                      timeout=240)
    assert result.returncode == 3  # storage error
    assert "s3://nowhere-bucket/ds" in result.stderr and "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_a_port_taken_before_the_server_binds_it_is_retried_on_fresh_ports(tmp_path, monkeypatch):
    """The test server's own start-up: another process takes the filer's port between the check
    and weed's bind (here a listening socket held on purpose), and the start is retried."""
    import socket

    from vitforge.testing import local_s3

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([None, None, port])
    pick_free = local_s3._free_base_port
    monkeypatch.setattr(local_s3, "_free_base_port", lambda host: next(picks, None) or pick_free(host))
    try:
        server = local_s3.start_local_s3(str(tmp_path / "weed"))
    finally:
        taken.close()
    try:
        assert server.client().list_buckets()["Buckets"] == []
        first = (tmp_path / "weed" / "weed.log.attempt1").read_text()
        assert f"port {port} for Filer" in first and "is not available" in first
    finally:
        server.stop()
