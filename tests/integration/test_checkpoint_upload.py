"""Checkpoint uploads that leave the training step alone: the upload threads run at the lowest CPU
priority, their number is bounded, botocore adds no CRC of its own to what they send (over plain
HTTP the signature still hashes each body: the one check in transit there), and the
one sha256 still catches a corrupt object or a receipt that does not match on restore.

Real SeaweedFS on 127.0.0.1, real threads; each request is observed from inside the thread that
sends it (botocore's before-send event), reading that thread's own nice value.
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from vitforge.core import CheckpointError, store_s3
from vitforge.core.store import UPLOAD_THREADS
from vitforge.trainer.uploader import UPLOAD_NICE, Uploader
from vitforge.trainer.run_store import UPLOAD_FILES, RunStore

PART = 5 << 20  # S3's smallest part, so a few MiB make multipart uploads of several parts
TAG = "step_00000001"


def _staged(folder, sizes: dict[str, int]) -> dict[str, str]:
    """Files of random bytes, as a rank's staging write leaves them; their sha256."""
    digests = {}
    for name, size in sizes.items():
        data = os.urandom(size)
        path = folder / TAG / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


@pytest.fixture
def uploaded(s3_env, bucket, tmp_path, monkeypatch):
    """Four multipart files and a small one uploaded by the checkpoint's Uploader; every request
    seen from its sending thread: (operation, that thread's nice, the request's headers, threads alive)."""
    monkeypatch.setattr(store_s3, "UPLOAD_PART_BYTES", PART)
    digests = _staged(tmp_path, {**{f"zero_pp_rank_{r}_optim_states.pt": 3 * PART + 100 for r in range(4)},
                                 "rank0_state.pt": 1000})
    run = RunStore(f"s3://{bucket}/runs/up")
    seen = []

    def record(request, **_):
        operation = "UploadPart" if "partNumber=" in request.url else request.method
        seen.append((operation, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), dict(request.headers),
                     threading.active_count()))

    run.store.client.meta.events.register("before-send.s3", record)
    before = threading.active_count()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    files = {}
    uploader = Uploader()
    uploader.start(lambda: files.update(run.upload_folder(str(tmp_path / TAG), TAG)))
    uploader.wait()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # training's thread keeps its own
    return run, files, digests, seen, before


def test_upload_threads_run_at_the_lowest_priority_and_are_bounded(uploaded):
    run, files, digests, seen, before = uploaded
    parts = [s for s in seen if s[0] == "UploadPart"]
    assert len(parts) == 4 * 4, [s[0] for s in seen]  # 4 files of 4 parts each: multipart really ran
    assert {s[1] for s in seen} == {UPLOAD_NICE}  # every request, from every thread the uploader started
    # The uploader, its file threads, and each file's part threads.
    bound = 1 + UPLOAD_FILES * (1 + UPLOAD_THREADS)
    assert max(s[3] for s in seen) - before <= bound, (max(s[3] for s in seen), before, bound)
    assert {name: meta["sha256"] for name, meta in files.items()} == digests


@pytest.mark.slow
def test_uploads_carry_no_crc_of_botocore_and_the_one_sha256_still_catches_corruption(uploaded, s3_server, bucket,
                                                                                       tmp_path):
    run, files, digests, seen, _ = uploaded
    sent = [headers for operation, _, headers, _ in seen if operation in ("UploadPart", "PUT")]
    assert sent
    for headers in sent:
        lower = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in headers.items()}
        assert not [k for k in lower if k.startswith("x-amz-checksum-") or k in (
            "content-md5", "x-amz-sdk-checksum-algorithm", "x-amz-trailer")], lower
        # Plain HTTP here: the signature's SHA-256 of the body is the one check in transit (over HTTPS,
        # TLS is, and bodies go unsigned).
        assert lower["x-amz-content-sha256"] != "UNSIGNED-PAYLOAD", lower
    manifest = {"files": files}
    names = sorted(files)
    run.fetch(TAG, names, manifest, str(tmp_path / "good"))  # what was sent is what the receipt says

    bad = dict(files, **{names[0]: {**files[names[0]], "sha256": "0" * 64}})  # a receipt that does not match
    with pytest.raises(CheckpointError, match=f"{names[0]}: sha256 differs"):
        run.fetch(TAG, names, {"files": bad}, str(tmp_path / "receipt"))

    key = f"runs/up/{TAG}/{names[1]}"  # one byte flipped in the store, the size unchanged
    client = s3_server["client"]
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointError, match=f"{names[1]}: sha256 differs"):
        run.fetch(TAG, names, manifest, str(tmp_path / "corrupt"))
