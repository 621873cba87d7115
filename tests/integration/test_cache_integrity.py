"""The node's shard cache trusts only bytes it checked, on a real S3 server (SeaweedFS):
a full disk fails a fetch cleanly and the loader reads from the store instead; a cached shard that
changed after its check is evicted and fetched again; a store object that differs from
dataset.json is an error naming both; a killed `vitforge shard` leaves no staging files behind
its next run."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import torch

from common.cli import REPO, vitforge
from vitforge.core import StorageError
from vitforge.pipeline import LoaderSpec, build_loader
from vitforge.pipeline.cache import cache_spec


@pytest.fixture(scope="module")
def shards(small_corpus, tmp_path_factory, s3_server):
    """120 samples in 3 shards of 40, in a local folder and in a bucket: (folder, s3:// URL, bucket)."""
    out = tmp_path_factory.mktemp("integrity") / "shards"
    vitforge("shard", small_corpus, out, "--shard-samples", "40", "--workers", "2")
    bucket = "ci-" + uuid.uuid4().hex[:10]
    s3_server["client"].create_bucket(Bucket=bucket)
    for path in sorted(out.iterdir()):
        if path.is_file():
            s3_server["client"].put_object(Bucket=bucket, Key=f"shards/{path.name}", Body=path.read_bytes())
    return out, f"s3://{bucket}/shards", bucket


def epoch(dataset, cache: Path | None = None):
    """One eval epoch, torch backend: [(keys, labels, images)] per batch, and the loader."""
    loader = build_loader(LoaderSpec(str(dataset), batch_size=8, image_size=32, workers=0, backend="torch",
                                     train=False, cache_dir=str(cache) if cache else None))
    return [(b["key"], b["label"].clone(), b["image"].clone()) for b in loader], loader


@pytest.fixture(scope="module")
def expected(shards):
    return epoch(shards[0])[0]


def assert_same(got, want) -> None:
    assert [keys for keys, _, _ in got] == [keys for keys, _, _ in want]
    for (_, labels, images), (_, want_labels, want_images) in zip(got, want):
        assert torch.equal(labels, want_labels)
        assert torch.equal(images, want_images)


def cached_shards(loader) -> list[Path]:
    """The shard files in the loader's node cache folder (no locks, markers or partial files)."""
    folder = Path(cache_spec(loader.spec, 0).folder)
    return sorted(p for p in folder.iterdir() if re.fullmatch(r".+\.tar-[0-9a-f]{12}-\d+", p.name))


def first_label_offset(tar_path: Path) -> int:
    with tarfile.open(tar_path) as tar:
        member = next(m for m in tar if m.name.endswith(".cls"))
    assert member.size == 1  # classes 0..4
    return member.offset_data


def change_a_label(path: Path, at: int) -> None:
    """Rewrite one label digit in place (another valid class), as a stray write would."""
    with open(path, "r+b") as f:
        f.seek(at)
        digit = int(f.read(1))
        f.seek(at)
        f.write(str((digit + 1) % 5).encode())


def test_a_full_disk_fails_the_fetch_cleanly_and_the_loader_reads_from_the_store(shards, expected, s3_env, tmp_path,
                                                                                  caplog):
    _, url, _ = shards
    cache = tmp_path / "cache"
    cache.mkdir()
    # A real full disk: a 64 KiB tmpfs holds the index files but no shard (about 200 KB each).
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(cache)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.fail(f"this test mounts a small tmpfs as a full cache disk and must run as root: {mounted.stderr}")
    try:
        with caplog.at_level(logging.WARNING, logger="vitforge.pipeline"):
            got, loader = epoch(url, cache)
        assert_same(got, expected)
        folder = cache_spec(loader.spec, 0).folder
        # No shard under its final name, no partial file: only the (empty) lock files.
        assert [n for n in os.listdir(folder) if not n.endswith(".lock")] == []
        lines = [r.getMessage() for r in caplog.records if folder in r.getMessage()]
        assert len(lines) == 1, lines
        assert "No space left on device" in lines[0] and "free in" in lines[0] and "from the store" in lines[0]
    finally:
        subprocess.run(["umount", "--lazy", str(cache)], check=True)  # lazy: a failed loader may hold files open


def test_a_truncated_cached_shard_is_fetched_again(shards, expected, s3_env, tmp_path, caplog):
    _, url, _ = shards
    cache = tmp_path / "cache"
    _, loader = epoch(url, cache)
    files = cached_shards(loader)
    assert len(files) == 3
    victim = files[0]
    os.truncate(victim, victim.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="vitforge.pipeline"):
        got, loader = epoch(url, cache)
    assert_same(got, expected)
    assert loader.stats()["shard_fetches"] == 1 and loader.stats()["bad_samples"] == 0
    assert str(victim) in caplog.text and url in caplog.text
    assert cached_shards(loader) == files
    # What a killed fetch left (its lock is free) is removed when the next reader starts, even
    # one that fetches nothing.
    dead = Path(f"{files[1]}.partial")
    dead.write_bytes(b"half a shard from a killed fetch")
    got, loader = epoch(url, cache)
    assert_same(got, expected)
    assert loader.stats()["shard_fetches"] == 0 and not dead.exists()


def test_changed_label_bytes_in_a_cached_shard_are_fetched_again_and_a_bad_object_is_an_error(shards, expected,
                                                                                             s3_env, s3_server,
                                                                                             tmp_path):
    local, url, bucket = shards
    cache = tmp_path / "cache"
    _, loader = epoch(url, cache)
    victim = cached_shards(loader)[0]
    name = victim.name.split(".tar-")[0] + ".tar"
    at = first_label_offset(local / name)
    change_a_label(victim, at)
    got, loader = epoch(url, cache)
    assert_same(got, expected)  # the labels are right, from a fresh copy
    assert loader.stats()["shard_fetches"] == 1
    # The store's object itself no longer matches dataset.json: the fetch after eviction fails
    # its check too, and that is an error naming the cache file and the object.
    original = (local / name).read_bytes()
    changed = bytearray(original)
    changed[at:at + 1] = str((int(original[at:at + 1]) + 1) % 5).encode()
    client = s3_server["client"]
    client.put_object(Bucket=bucket, Key=f"shards/{name}", Body=bytes(changed))
    try:
        change_a_label(victim, at)
        with pytest.raises(StorageError) as error:
            epoch(url, cache)
        assert str(victim) in str(error.value) and f"{url}/{name}" in str(error.value)
        assert "dataset.json" in str(error.value)
        assert not victim.exists() and not Path(f"{victim}.partial").exists()
    finally:
        client.put_object(Bucket=bucket, Key=f"shards/{name}", Body=original)


def test_a_killed_shard_run_leaves_no_staging_files_after_the_next_run(small_corpus, tmp_path, s3_server, bucket):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**s3_server["env"], "TMPDIR": str(tmp)}
    staging = tmp / "vitforge-staging"
    for attempt in range(5):  # until a kill lands while a shard is staged (nearly always the first)
        cmd = [sys.executable, "-m", "vitforge", "shard", str(small_corpus), f"s3://{bucket}/run{attempt}",
               "--shard-samples", "4", "--workers", "1"]
        process = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not list(staging.glob("*.partial-*")) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait()
        if list(staging.glob("*.partial-*")):
            break
    leftovers = list(staging.glob("*.partial-*"))
    assert leftovers, "no kill landed while a shard was staged"
    vitforge(*cmd[3:], env=env)
    assert not list(staging.glob("*.partial-*")), leftovers
