"""Upload and download MB/s of one file on loopback, through our Store and through the cloud's
own SDK doing the same transfer (same file, same emulator, same run), side by side.

    .venv/bin/python -m benchmarks.store_bench [--mb 200] [--repeats 2] [--backends gcs]

The local backend compares a local folder store (temporary, fsync, rename) with a plain
`shutil.copyfile`: the floor. Each backend is one entry of BACKENDS: how to start its emulator
(returning its client environment, a fresh bucket and a stop function) and the SDK's plain upload
and download of a file. Best of
`repeats` for each figure: loopback on a shared machine is noisy, and the best is the least disturbed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from vitforge.core import open_store


@dataclass(frozen=True)
class Emulator:
    env: dict  # the client environment pointing at it
    bucket: str  # a fresh, empty bucket
    stop: Callable[[], None]


@dataclass(frozen=True)
class Backend:
    scheme: str  # the store's URL scheme: our side opens f"{scheme}://{bucket}/bench" (local: a folder)
    start: Callable[[str], Emulator]  # (scratch folder) -> a running emulator
    sdk_upload: Callable[[Emulator, str, str], None]  # (emulator, local file, object key)
    sdk_download: Callable[[Emulator, str, str], None]  # (emulator, object key, local file)


def _start_gcs(folder: str) -> Emulator:
    from vitforge.testing import start_local_gcs

    server = start_local_gcs(folder)
    return Emulator(server.env, server.make_bucket("store-bench"), server.stop)


def _gcs_bucket(emulator: Emulator):
    from google.cloud import storage

    return storage.Client(project=emulator.env["GOOGLE_CLOUD_PROJECT"]).bucket(emulator.bucket)


def _start_azure(folder: str) -> Emulator:
    from vitforge.testing import start_local_azure

    server = start_local_azure(folder)
    server.client().create_container("store-bench")
    return Emulator(server.env, "store-bench", server.stop)


def _azure_blob(emulator: Emulator, key: str):
    from azure.storage.blob import BlobClient

    return BlobClient.from_connection_string(emulator.env["AZURE_STORAGE_CONNECTION_STRING"], emulator.bucket, key)


def _azure_upload(emulator: Emulator, path: str, key: str) -> None:
    with open(path, "rb") as f:
        _azure_blob(emulator, key).upload_blob(f, overwrite=True, max_concurrency=8)


def _azure_download(emulator: Emulator, key: str, path: str) -> None:
    with open(path, "wb") as f:
        _azure_blob(emulator, key).download_blob(max_concurrency=8).readinto(f)


def _start_s3(folder: str) -> Emulator:
    from vitforge.testing import start_local_s3

    server = start_local_s3(folder)
    server.client().create_bucket(Bucket="store-bench")
    return Emulator(server.env, "store-bench", server.stop)


def _s3_client(emulator: Emulator):
    import boto3

    return boto3.client("s3")  # the AWS variables of emulator.env are set while the backend runs


def _start_local(folder: str) -> Emulator:
    os.makedirs(folder, exist_ok=True)
    return Emulator({}, folder, lambda: None)


def _copy(source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(source, target)


BACKENDS: dict[str, Backend] = {
    "local": Backend("file", _start_local, lambda e, path, key: _copy(path, os.path.join(e.bucket, key)),
                     lambda e, key, path: _copy(os.path.join(e.bucket, key), path)),
    "s3": Backend("s3", _start_s3,
                  lambda e, path, key: _s3_client(e).upload_file(path, e.bucket, key),
                  lambda e, key, path: _s3_client(e).download_file(e.bucket, key, path)),
    "gcs": Backend("gs", _start_gcs,
                   lambda e, path, key: _gcs_bucket(e).blob(key).upload_from_filename(path),
                   lambda e, key, path: _gcs_bucket(e).blob(key).download_to_filename(path)),
    "azure": Backend("az", _start_azure, _azure_upload, _azure_download),
}


@contextlib.contextmanager
def _environment(env: dict):
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(name: str, backend: Backend, source: str, scratch: str, repeats: int) -> dict[str, float]:
    """Best MB/s of each of the four transfers; every download checked against the source."""
    size_mb = os.path.getsize(source) / 1e6
    with open(source, "rb") as f:
        want = hashlib.file_digest(f, "sha256").hexdigest()
    emulator = backend.start(os.path.join(scratch, name))
    back = os.path.join(scratch, "back")
    best = {"ours_up": 0.0, "sdk_up": 0.0, "ours_down": 0.0, "sdk_down": 0.0}
    try:
        with _environment(emulator.env):
            root = f"{emulator.bucket}/bench" if backend.scheme == "file" else f"{backend.scheme}://{emulator.bucket}/bench"
            store = open_store(root)
            for _ in range(repeats):
                seconds = {
                    "ours_up": _timed(lambda: store.put_file(source, "ours.bin", keep=True)),
                    "sdk_up": _timed(lambda: backend.sdk_upload(emulator, source, "bench/sdk.bin")),
                    "ours_down": _timed(lambda: store.download("ours.bin", back)),
                }
                _check(back, want, "ours")
                seconds["sdk_down"] = _timed(lambda: backend.sdk_download(emulator, "bench/sdk.bin", back))
                _check(back, want, "sdk")
                store.delete(["ours.bin", "sdk.bin"])  # the emulator holds objects in memory
                best = {key: max(best[key], size_mb / seconds[key]) for key in best}
    finally:
        emulator.stop()
    return best


def _check(path: str, want: str, who: str) -> None:
    with open(path, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != want:
            raise AssertionError(f"{who}: the downloaded file differs from the uploaded one")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="file size in MB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="store-bench-") as scratch:
        source = os.path.join(scratch, "source.bin")
        with open(source, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1_000_000))
        for name in args.backends.split(","):
            best = bench(name, BACKENDS[name], source, scratch, args.repeats)
            print(f"{name}: {args.mb} MB upload   ours {best['ours_up']:7.1f} MB/s  "
                  f"sdk {best['sdk_up']:7.1f} MB/s  ratio {best['ours_up'] / best['sdk_up']:.2f}")
            print(f"{name}: {args.mb} MB download ours {best['ours_down']:7.1f} MB/s  "
                  f"sdk {best['sdk_down']:7.1f} MB/s  ratio {best['ours_down'] / best['sdk_down']:.2f}")


if __name__ == "__main__":
    main()
