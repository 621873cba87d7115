"""gs:// as a store, against fake-gcs-server on 127.0.0.1 (and, for faults, the fault proxy in front
of it): the guarantees of core/store.py, then shard, train, signal, resume and export on gs://.

The store contract itself (conditional create, compare-and-swap, pinned ranged reads, listing, a
missing bucket, wrong credentials, a cut transfer) is tests/integration/test_store_contract.py's, for every
backend. What fake-gcs-server cannot show (verified): it ignores preconditions on resumable uploads
(above 8 MiB) and on deletes, and ifGenerationMatch on reads, and appends a resumable part sent
again instead of placing it at its offset. The code keeps those guarantees for GCS (put_if sends
ifGenerationMatch, get_range pins the generation in the URL too, parts are resent at their offset).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

from common.checks import assert_same_weights, losses, weights
from common.cli import STRAIGHT, start_ranks, train, vitforge
from common.faulty_proxy import FaultSchedule, start_proxy
from vitforge.core import errors, open_store
from vitforge.shards.sources import list_corpus


def test_throttling_and_cut_downloads_are_retried_and_every_request_counted(gcs_server, monkeypatch, tmp_path):
    """What the contract suite (tests/integration/test_store_contract.py, gcs) leaves to this file: 503 answers
    retried too, every attempt counted in `requests`, and the GCS-only details (an empty range, no
    uploads to abort). Only downloads' answers are cut: fake-gcs-server appends a part sent again."""
    bucket = gcs_server["make_bucket"]()
    schedule = FaultSchedule(slow_down_every=5, reset_every=7, cut_body_every=3, cut_only=("GET",))
    port = int(gcs_server["env"]["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    proxy, proxy_port = start_proxy(port, schedule)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{proxy_port}")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", gcs_server["env"]["GOOGLE_CLOUD_PROJECT"])
    try:
        store = open_store(f"gs://{bucket}/faults")
        payload = os.urandom(9 << 20)  # above 8 MiB: a resumable upload
        (tmp_path / "f").write_bytes(payload)
        store.put_file(str(tmp_path / "f"), "f", keep=True)
        store.put_bytes("small", b"s" * 5000)
        for _ in range(3):
            assert store.get_bytes("small") == b"s" * 5000
        assert store.download("f", str(tmp_path / "g"), part_bytes=1 << 20, threads=4) == \
            hashlib.sha256(payload).hexdigest()
        assert store.get_range("f", 5, 5) == b"" and store.abort_uploads("") == 0
    finally:
        proxy.shutdown()
    assert all(schedule.injected.values()), schedule.injected  # every kind of fault happened, and was survived
    assert store.requests == len(schedule.requests)  # every attempt, retries included, was counted


# --- end to end ---------------------------------------------------------------------------------

def test_a_key_with_an_empty_path_segment_is_left_out_of_a_listing(gcs_server, monkeypatch):
    """"raw//stray/1.jpg" (buggy uploaders make such keys; SeaweedFS folds them, GCS keeps them):
    its folder's name is empty, so listing it would list its parent again, for ever."""
    for key, value in gcs_server["env"].items():
        monkeypatch.setenv(key, value)
    bucket = gcs_server["make_bucket"]()
    from google.cloud import storage

    client = storage.Client(project=gcs_server["env"]["GOOGLE_CLOUD_PROJECT"])
    for key in ("raw/cat/1.jpg", "raw/dog/2.jpg", "raw//stray/3.jpg"):
        client.bucket(bucket).blob(key).upload_from_string(b"x")
    for labelled, want in ((True, ["cat/1.jpg", "dog/2.jpg"]), (False, ["cat/1.jpg", "dog/2.jpg"])):
        assert [r.name for r in list_corpus(f"gs://{bucket}/raw", labelled=labelled).records] == want


@pytest.mark.slow
def test_shard_train_signal_resume_and_export_on_gcs_equal_the_local_run(data, straight, gcs_server, tmp_path,
                                                                          monkeypatch):
    """The corpus sharded to gs://, 2 ranks trained from it with checkpoints on gs://, SIGUSR1 to
    one rank, a resume, an export: the same losses and weights as the uninterrupted local run."""
    env = gcs_server["env"]
    bucket = gcs_server["make_bucket"]()
    vitforge("shard", data / "train_src", f"gs://{bucket}/train", "--shard-samples", "64", "--workers", "2", env=env)
    store, logs = f"gs://{bucket}/runs", tmp_path / "logs"
    common = [*STRAIGHT, f"data.train=gs://{bucket}/train", f"checkpoint.log_dir={logs}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    ranks = start_ranks(data, "gsrun", *common, store=store, env=env)
    deadline = time.monotonic() + 120
    while not (logs / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    ranks[1].send_signal(signal.SIGUSR1)
    outputs = [r.communicate(timeout=240) for r in ranks]
    assert [r.returncode for r in ranks] == [errors.REQUEUE, errors.REQUEUE], outputs[0][1][-3000:]
    step = int(outputs[0][1].split("stopped at step ")[1].split()[0])
    resumed = train(data, "gsrun", *common, store=store, env=env)
    assert f"at step {step}" in resumed.stderr and f"{store}/gsrun/step_{step:08d}" in resumed.stderr
    assert losses(logs) == losses(straight)
    exported = vitforge("ckpt", "export", f"{store}/gsrun", "--out", tmp_path / "model.safetensors", env=env)
    assert exported.returncode == 0 and (tmp_path / "model.safetensors").stat().st_size > 0
    for key, value in env.items():  # weights() reads the checkpoint in this process
        monkeypatch.setenv(key, value)
    assert_same_weights(weights(f"{store}/gsrun"), weights(str(straight)))
