"""Object storage for shards and checkpoints: a local folder or S3, with all-or-nothing writes.

Local writes land under a temporary name in the same filesystem and are renamed into place;
object-store writes are single PUTs or multipart uploads, which S3 makes visible only when
complete. Endpoint, region and credentials come from the standard AWS chain (AWS_ENDPOINT_URL,
AWS_PROFILE, ...), never from our arguments, so no secret reaches a log line or a manifest.

Retries: botocore retries throttling, 5xx, resets and timeouts itself (AWS_MAX_ATTEMPTS /
AWS_RETRY_MODE honoured, default 5 attempts in standard mode); we add a retry only for what it does
not (a body cut short), so the two never multiply into minutes of waiting. Every request, and
fsspec's s3:// through the same hooks, keeps the bounds of retry.py: per-attempt timeouts, a log
line per failed attempt, a deadline. Denials (403, a bad signature, a missing bucket) are never
retried.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec

from .errors import PreconditionFailed, StorageError, UsageError
from .files import PARTIAL_MARK, atomic_write
from .retry import StoreLimits, TransientError, current_operation, past_deadline, store_limits, with_retries

log = logging.getLogger("vitforge.store")

# fsspec's s3:// (corpus sources, tar-path datasets) gets S3Store's bounds; s3fs is imported on first use.
for _scheme in ("s3", "s3a"):
    fsspec.register_implementation(_scheme, "vitforge.core.s3fs_bounded.BoundedS3FileSystem", clobber=True)

def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def open_store(url: str, work_dir: str = "_work/tmp") -> "LocalStore | S3Store":
    """`work_dir`: where a local store keeps temporaries (inside the store, so renames are atomic)."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise UsageError(f"{url}: no bucket in the URL")
        return S3Store(bucket, prefix.strip("/"))
    if "://" in url and not url.startswith("file://"):
        raise UsageError(f"{url}: only local folders, file:// and s3:// URLs are supported")
    root = os.path.abspath(url.removeprefix("file://"))
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"{url}: is a file, not a folder")
    return LocalStore(root, work_dir)


@dataclass
class LocalStore:
    root: str
    work_dir: str = "_work/tmp"

    def url(self, name: str) -> str:
        return os.path.join(self.root, name) if name else self.root

    def temp_path(self, name: str) -> str:
        return _temp_name(self._temp_dir(), name)

    def put_file(self, local_path: str, name: str, keep: bool = False) -> None:
        """Move (or with `keep`, copy) a local file into the store, all or nothing."""
        target = self.url(name)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if keep or not _same_device(local_path, self._temp_dir()):
                tmp = self.temp_path(name)
                try:
                    shutil.copyfile(local_path, tmp)
                    _fsync(tmp)
                    os.replace(tmp, target)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                if not keep:
                    os.unlink(local_path)
            else:
                os.replace(local_path, target)
        except OSError as e:
            raise _local_error(target, e) from None

    def put_bytes(self, name: str, data: bytes) -> None:
        try:
            os.makedirs(os.path.dirname(self.url(name)), exist_ok=True)
            atomic_write(self.url(name), data, self.temp_path(name))
        except OSError as e:
            raise _local_error(self.url(name), e) from None

    def get_bytes(self, name: str) -> bytes:
        try:
            with open(self.url(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url(name)}: no such file") from None
        except OSError as e:
            raise _local_error(self.url(name), e) from None

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        """(bytes, version tag) or None: what `put_if` compares against."""
        try:
            data = self.get_bytes(name)
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        """Write only if the object is still at `version` (None: only if absent). Compare and
        swap under an exclusive lock on a lock file beside it; returns the new version."""
        path = self.url(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self.get_versioned(name)
            if (current[1] if current else None) != version:
                raise PreconditionFailed(f"{path}: changed by another writer")
            atomic_write(path, data)
        return hashlib.sha256(data).hexdigest()

    def download(self, name: str, local_path: str) -> str:
        """Copy to a local file; return the sha256 of what was written (hashed as it is copied)."""
        digest = hashlib.sha256()
        try:
            with open(self.url(name), "rb") as source, open(local_path, "wb") as target:
                while chunk := source.read(8 << 20):
                    digest.update(chunk)
                    target.write(chunk)
            return digest.hexdigest()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url(name)}: no such file") from None
        except OSError as e:
            raise _local_error(self.url(name), e) from None

    def exists(self, name: str) -> bool:
        return os.path.exists(self.url(name))

    def list(self, prefix: str) -> list[str]:
        """Names directly under `prefix` (files and folders)."""
        folder = self.url(prefix)
        if not os.path.isdir(folder):
            return []
        return sorted(os.path.join(prefix, n) for n in os.listdir(folder))

    def walk(self, prefix: str = "") -> dict[str, int]:
        """Every file under `prefix` (recursively) with its size, temporaries excluded."""
        found = {}
        base = self.url(prefix)
        for root, _, names in os.walk(base):
            for n in names:
                if PARTIAL_MARK in n or n.endswith(".lock"):
                    continue
                path = os.path.join(root, n)
                try:
                    found[os.path.relpath(path, self.root)] = os.path.getsize(path)
                except FileNotFoundError:
                    continue  # deleted while we walked
        return found

    def delete(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.url(name))
        for folder in sorted({os.path.dirname(self.url(n)) for n in names}, key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.removedirs(folder)

    def abort_uploads(self, prefix: str) -> int:
        """Remove the temporaries of dead writers on this host (a local store keeps every
        temporary in its one work folder, whatever the prefix)."""
        folder = self._temp_dir()
        return _discard_stale(folder, set()) if os.path.isdir(folder) else 0

    def local_copy(self, name: str, folder: str) -> str:
        return self.url(name)

    def local_path(self, name: str) -> str | None:
        """Where the object already lies on this machine, so callers can skip a download."""
        return self.url(name)

    def discard_stale_temporaries(self, shard_names: set[str]) -> None:
        _discard_stale(self._temp_dir(), shard_names)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self._temp_dir())  # fails while another part still writes there

    def _temp_dir(self) -> str:
        folder = os.path.join(self.root, self.work_dir)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise _local_error(folder, e) from None
        return folder


def _same_device(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _local_error(path: str, e: OSError) -> StorageError:
    return StorageError(f"{path}: {e.strerror or e}")


class LocalWriteError(StorageError):
    """A local file could not be written whole: a full disk, a quota, a file size limit."""


def local_write_error(path: str, e: OSError) -> LocalWriteError:
    """Names the file, the cause and the room left, which is what a full disk needs to be fixed."""
    folder = os.path.dirname(os.path.abspath(path))
    return LocalWriteError(f"{path}: {e.strerror or e} ({shutil.disk_usage(folder).free / 1e6:.1f} MB free in "
                           f"{folder})")


def _write_all(fd: int, data: bytes, offset: int, path: str) -> None:
    """pwrite until every byte is down: a filling disk first writes short, then fails (ENOSPC)."""
    view = memoryview(data)
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view, offset = view[written:], offset + written
    except OSError as e:
        raise local_write_error(path, e) from None


def _staging_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "vitforge-staging")


TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                   "InternalError", "ServiceUnavailable", "500", "502", "503", "504"}


@contextlib.contextmanager
def _named(url: str):
    """botocore's errors name the endpoint, not the object: say which s3:// URL failed, and why,
    in one line, without any credential."""
    from botocore.exceptions import (BotoCoreError, ClientError, ConnectionClosedError, ConnectTimeoutError,
                                     EndpointConnectionError, IncompleteReadError, NoCredentialsError,
                                     ReadTimeoutError, ResponseStreamingError)

    try:
        yield
    except ClientError as e:
        error = e.response.get("Error", {})
        code = str(error.get("Code"))
        if code in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"{url}: no such object") from None
        if code in ("412", "PreconditionFailed", "ConditionalRequestConflict"):
            raise PreconditionFailed(f"{url}: changed by another writer") from None
        if code in TRANSIENT_CODES:
            raise TransientError(f"{url}: {code}: {error.get('Message', '')}") from None
        raise StorageError(f"{url}: {code}: {error.get('Message') or 'request refused'}") from None
    except NoCredentialsError:
        raise StorageError(f"{url}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                           "AWS_PROFILE, or an instance role)") from None
    except (EndpointConnectionError, ConnectTimeoutError) as e:
        raise StorageError(f"{url}: {e} (after botocore's retries)") from None
    except (ResponseStreamingError, IncompleteReadError, ConnectionClosedError, ReadTimeoutError) as e:
        raise TransientError(f"{url}: {e}") from None  # a body cut short: botocore does not retry it
    except BotoCoreError as e:
        raise StorageError(f"{url}: {e}") from None


@dataclass(frozen=True)
class _RequestBound:
    what: str  # "GetObject s3://bucket/key"
    deadline: float  # time.monotonic()


def bound_requests(events, limits: StoreLimits) -> None:
    """Hook a boto3 or aiobotocore S3 client's events so that each request, botocore's own retries
    included, logs every failed attempt (operation, attempt n/N, endpoint, error class) and gives
    up at its first failure after the deadline: the enclosing operation's (`with_retries`) or its own."""

    def start(params: dict, context: dict, model, **_) -> None:
        enclosing = current_operation()
        deadline = enclosing.deadline if enclosing else time.monotonic() + limits.deadline_s
        target = params.get("Key", params.get("Prefix", ""))
        context["vitforge_bound"] = _RequestBound(f"{model.name} s3://{params.get('Bucket', '')}/{target}", deadline)

    def check(attempts: int, endpoint, request_dict: dict, response=None, caught_exception=None, **_) -> None:
        bound = request_dict["context"].get("vitforge_bound")
        error = _failure(response, caught_exception)
        if bound is None or error is None:
            return None  # not ours, or an answer botocore will not retry: let it decide
        where = f"{bound.what} at {endpoint.host}"
        if time.monotonic() >= bound.deadline:
            raise past_deadline(where, attempts, error)
        if attempts < limits.attempts:
            log.warning("%s: attempt %d/%d failed: %s; %.1f s left before the deadline", where, attempts,
                        limits.attempts, error, bound.deadline - time.monotonic())
        return None

    events.register("before-parameter-build.s3", start, unique_id="vitforge-bound-start")
    events.register_first("needs-retry.s3", check, unique_id="vitforge-bound-check")


def _failure(response, caught_exception) -> str | None:
    """What went wrong with an attempt, when it is what botocore retries: no answer, 5xx, throttling."""
    if caught_exception is not None:
        return type(caught_exception).__name__
    http, parsed = response
    code = str(parsed.get("Error", {}).get("Code", ""))
    return f"{http.status_code} {code}".strip() if http.status_code >= 500 or code in TRANSIENT_CODES else None


def _temp_name(folder: str, name: str) -> str:
    """Host and pid in the name let a rerun tell a dead writer's leftovers from a live one's."""
    return os.path.join(folder, f"{name.replace('/', '%')}{PARTIAL_MARK}{socket.gethostname()}-{os.getpid()}")


def _discard_stale(folder: str, shard_names: set[str]) -> int:
    """Remove what killed writers left: anything of the shards we own (tar, index, record), and
    any other temporary whose writer ran on this host and is gone. Other writers' live files stay."""
    stems = tuple(name.replace("/", "%").removesuffix(".tar") + "." for name in shard_names)
    removed = 0
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        base, _, writer = entry.partition(PARTIAL_MARK)
        host, _, pid = writer.rpartition("-")
        ours = any(stem in base for stem in stems)
        if ours or (host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, entry))
            removed += 1
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class S3Store:
    bucket: str
    prefix: str
    _client: object = field(default=None, repr=False)
    # HTTP requests this store has sent, botocore's own retries included: what the store bills.
    requests: int = field(default=0, compare=False)
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            limits = store_limits()
            self._client = boto3.client("s3", config=Config(**limits.botocore_config(), max_pool_connections=32))
            self._client.meta.events.register("before-send.s3", self._count_request)
            bound_requests(self._client.meta.events, limits)
        return self._client

    def _count_request(self, **_) -> None:
        with self._count_lock:
            self.requests += 1

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}".strip("/") if self.prefix else name

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def temp_path(self, name: str) -> str:
        """Shards are staged on local disk, then uploaded whole."""
        folder = _staging_dir()
        os.makedirs(folder, exist_ok=True)
        return _temp_name(folder, f"{self.bucket}/{self.key(name)}")

    def put_file(self, local_path: str, name: str, keep: bool = False) -> None:
        """Parallel multipart upload (64 MiB parts, 8 threads); S3 shows the object only when whole."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)
        with _named(self.url(name)):
            self.client.upload_file(local_path, self.bucket, self.key(name), Config=config)
        if not keep:
            os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        with _named(self.url(name)):
            self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)

    def get_bytes(self, name: str) -> bytes:
        def fetch() -> bytes:
            with _named(self.url(name)):
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                body = response["Body"].read()
            if len(body) != response["ContentLength"]:
                # botocore does not retry a body cut short (docs/ARCHITECTURE.md, measured facts).
                raise TransientError(f"short read: {len(body)} of {response['ContentLength']} bytes")
            return body

        return with_retries(fetch, f"get {self.url(name)}")

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        def fetch():
            with _named(self.url(name)):
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                return response["Body"].read(), response["ETag"]

        try:
            return with_retries(fetch, f"get {self.url(name)}")
        except FileNotFoundError:
            return None

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        """S3 conditional write: If-None-Match '*' when absent, If-Match ETag otherwise."""
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        with _named(self.url(name)):
            return self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data, **condition)["ETag"]

    def download(self, name: str, local_path: str, part_bytes: int = 16 << 20, threads: int = 8,
                 length: int | None = None) -> str:
        """Parallel ranged GETs of one version of the object (If-Match its ETag), written in place;
        returns the sha256 of the bytes, hashed in order as the parts arrive, so checking a
        download costs no second pass over the file. A part cut short is fetched again; a write
        that cannot be completed (a full disk, a quota) raises LocalWriteError.
        `length`: fetch only the first `length` bytes, without the HEAD request (and its ETag pin)."""
        url = self.url(name)
        if length is None:
            with _named(url):
                head = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
            size, pin = head["ContentLength"], {"IfMatch": head["ETag"]}
        else:
            size, pin = length, {}
        digest = hashlib.sha256()
        fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

        def part(start: int) -> bytes:
            data = self.get_range(name, start, min(start + part_bytes, size), pin)
            _write_all(fd, data, start, local_path)
            return data

        try:
            with ThreadPoolExecutor(threads) as pool:
                starts = iter(range(0, size, part_bytes))
                pending = deque(pool.submit(part, s) for s in itertools.islice(starts, threads))
                while pending:
                    digest.update(pending.popleft().result())
                    following = next(starts, None)
                    if following is not None:
                        pending.append(pool.submit(part, following))
        finally:
            os.close(fd)
        return digest.hexdigest()

    def get_range(self, name: str, start: int, end: int, pin: dict | None = None) -> bytes:
        """Bytes [start, end) of the object in one ranged GET; a body cut short is fetched again."""
        url = self.url(name)

        def fetch() -> bytes:
            with _named(url):
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(name),
                                                  Range=f"bytes={start}-{end - 1}", **(pin or {}))
                body = response["Body"].read()
            if len(body) != end - start:
                raise TransientError(f"short read: {len(body)} of {end - start} bytes at {start}")
            return body

        return with_retries(fetch, f"get {url}")

    def exists(self, name: str) -> bool:
        try:
            with _named(self.url(name)):
                self.client.head_object(Bucket=self.bucket, Key=self.key(name))
            return True
        except FileNotFoundError:
            return False

    def list(self, prefix: str) -> list[str]:
        return sorted(prefix.rstrip("/") + "/" + name for name in self._objects(prefix))

    def walk(self, prefix: str = "") -> dict[str, int]:
        base = f"{prefix.rstrip('/')}/" if prefix else ""
        return {base + name: size for name, size in self._objects(prefix).items()}

    def _objects(self, prefix: str) -> dict[str, int]:
        base = self.key(prefix).rstrip("/") + "/" if self.key(prefix) else ""
        found = {}
        with _named(self.url(prefix)):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                found.update({o["Key"][len(base):]: o["Size"] for o in page.get("Contents", [])})
        return found

    def delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):
            chunk = [{"Key": self.key(n)} for n in names[start:start + 1000]]
            with _named(self.url(names[start])):
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def abort_uploads(self, prefix: str) -> int:
        """Abort multipart uploads under `prefix` that a dead writer left (they cost storage)."""
        aborted = 0
        with _named(self.url(prefix)):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.key(prefix).rstrip("/") + "/")
            for page in pages:
                for upload in page.get("Uploads", []):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
                    aborted += 1
        return aborted

    def local_copy(self, name: str, folder: str) -> str:
        path = os.path.join(folder, os.path.basename(name))
        self.download(name, path)
        return path

    def local_path(self, name: str) -> str | None:
        return None

    def discard_stale_temporaries(self, names: set[str]) -> None:
        """S3 never shows a partial object; what killed writers left is their staging files on
        this host: those of our shards, and any other whose writer is gone."""
        _discard_stale(_staging_dir(), {f"{self.bucket}/{self.key(n)}" for n in names})

    def finish(self) -> None:
        pass
