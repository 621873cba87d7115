"""S3 (and S3-compatible stores) as a Store, through boto3.

Writes are single PUTs or multipart uploads, which S3 makes visible only when complete; put_if
is a conditional PUT (If-None-Match / If-Match on the ETag). Endpoint, region and credentials come
from the standard AWS chain (AWS_ENDPOINT_URL, AWS_PROFILE, ...), never from our arguments.

Retries: botocore retries throttling, 5xx, resets and timeouts itself (AWS_MAX_ATTEMPTS /
AWS_RETRY_MODE honoured, default 5 attempts in standard mode); we add a retry only for what it does
not (a body cut short), so the two never multiply into minutes of waiting. Every request keeps the
bounds of retry.py: per-attempt timeouts, a log line per failed attempt, a deadline. Denials (403,
a bad signature, a missing bucket) are never retried.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .errors import PreconditionFailed, StorageError
from .retry import (
    StoreLimits,
    TransientError,
    current_operation,
    past_deadline,
    store_limits,
    with_retries,
    with_retries_if_present,
)
from .store import UPLOAD_THREADS, ObjectInfo, StagedStore, bucket_and_prefix, whole

log = logging.getLogger("vitforge.store")
LIST_PAGE_KEYS = 1000  # keys per listing page (S3's most): what a listing holds at a time
UPLOAD_PART_BYTES = 64 << 20  # per multipart part (S3's least is 5 MiB): x (UPLOAD_THREADS + 1) is what an upload holds
# What botocore would hash besides our own sha256 (RunStore's receipt, checked again on every restore):
# a CRC32 of every request (botocore >= 1.36, "when_supported"), and a SHA-256 of every body for the
# signature. Both are a pass over every byte of a checkpoint on the CPUs that train. The CRC goes
# (S3 still gets the checksums its API requires: DeleteObjects); the body's SHA-256 goes only over
# HTTPS, where TLS authenticates every byte in transit: over plain HTTP it is the only check in transit.
NO_EXTRA_CHECKSUMS = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
UNSIGNED_BODIES_OVER_TLS = {"s3": {"payload_signing_enabled": False}}
MAX_PARTS = 10_000  # S3's most parts in one multipart upload


def open_s3(url: str, work_dir: str) -> S3Store:
    return S3Store(*bucket_and_prefix(url))


TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "502",
    "503",
    "504",
}


@contextlib.contextmanager
def _named(url: str):
    """botocore's errors name the endpoint, not the object: say which s3:// URL failed, and why,
    in one line, without any credential."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        NoCredentialsError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

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
        raise StorageError(
            f"{url}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or an instance role)"
        ) from None
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
    """Hook a boto3 S3 client's events so that each request, botocore's own retries
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
            log.warning(
                "%s: attempt %d/%d failed: %s; %.1f s left before the deadline",
                where,
                attempts,
                limits.attempts,
                error,
                bound.deadline - time.monotonic(),
            )
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


# boto3's default session is not thread-safe: clients made from it at once (the sharder's stat
# threads, a reader and its prefetch thread) can fail while it resolves credentials.
_CLIENT_LOCK = threading.Lock()


@dataclass
class S3Store(StagedStore):
    bucket: str
    prefix: str
    _client: object = field(default=None, repr=False)

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            with _CLIENT_LOCK:
                if self._client is None:
                    limits = store_limits()
                    settings = {**limits.botocore_config(), **NO_EXTRA_CHECKSUMS, "max_pool_connections": 32}
                    client = boto3.client("s3", config=Config(**settings))
                    if client.meta.endpoint_url.startswith("https://"):
                        client = boto3.client("s3", config=Config(**settings, **UNSIGNED_BODIES_OVER_TLS))
                    client.meta.events.register("before-send.s3", self.count_request)
                    bound_requests(client.meta.events, limits)
                    self._client = client
        return self._client

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}".strip("/") if self.prefix else name

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def staging_key(self, name: str) -> str:
        return f"{self.bucket}/{self.key(name)}"

    def put_file(self, local_path: str, name: str, keep: bool = False) -> str:
        """One PUT up to UPLOAD_PART_BYTES, else a multipart upload of UPLOAD_PART_BYTES parts,
        UPLOAD_THREADS at a time (S3 shows the object only when whole; a failed one is aborted).
        Returns the sha256 of the bytes sent: each part is read once, sent from memory and hashed
        in order, so checking costs no second pass over the file. From memory, a part's send holds
        the GIL once, where a streamed file body takes it back every 16 KiB: that churn slows a
        training thread in the same process. The part threads start from the calling thread and
        inherit its CPU priority. Holds at most UPLOAD_THREADS + 1 parts in memory."""
        digest = hashlib.sha256()
        with open(local_path, "rb") as f, _named(self.url(name)):
            size = os.fstat(f.fileno()).st_size
            if size <= UPLOAD_PART_BYTES:
                data = f.read()
                digest.update(data)
                self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)
            else:
                self._put_parts(f.fileno(), size, name, digest)
        if not keep:
            os.unlink(local_path)
        return digest.hexdigest()

    def _put_parts(self, fd: int, size: int, name: str, digest) -> None:
        key = self.key(name)
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        part_bytes = max(UPLOAD_PART_BYTES, -(-size // MAX_PARTS))  # past 625 GiB, larger parts

        def part(number: int, start: int) -> tuple[bytes, dict]:
            length = min(part_bytes, size - start)
            data = os.pread(fd, length, start)
            if len(data) != length:
                raise StorageError(f"{self.url(name)}: the local file shrank while it was uploaded")
            answer = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number, Body=data)
            return data, {"PartNumber": number, "ETag": answer["ETag"]}

        try:
            with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
                starts = enumerate(range(0, size, part_bytes), start=1)
                pending = deque(pool.submit(part, n, s) for n, s in itertools.islice(starts, UPLOAD_THREADS))
                parts = []
                while pending:
                    data, sent = pending.popleft().result()
                    digest.update(data)
                    parts.append(sent)
                    following = next(starts, None)
                    if following is not None:
                        pending.append(pool.submit(part, *following))
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):  # what cannot be aborted now, clean_incomplete aborts later
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise

    def put_bytes(self, name: str, data: bytes) -> None:
        with _named(self.url(name)):
            self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)

    def get_bytes(self, name: str) -> bytes:
        def fetch() -> bytes:
            with _named(self.url(name)):
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                body = response["Body"].read()
            return whole(body, response["ContentLength"])

        return with_retries(fetch, f"get {self.url(name)}")

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        def fetch():
            with _named(self.url(name)):
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                return response["Body"].read(), response["ETag"]

        return with_retries_if_present(fetch, f"get {self.url(name)}")

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        """S3 conditional write: If-None-Match '*' when absent, If-Match ETag otherwise."""
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        with _named(self.url(name)):
            return self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data, **condition)["ETag"]

    def stat(self, name: str) -> ObjectInfo:
        with _named(self.url(name)):
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        return ObjectInfo(head["ContentLength"], head["ETag"])

    def get_range(self, name: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes [start, end) of the object in one ranged GET; a body cut short is fetched again."""
        if end <= start:
            return b""  # "bytes=s-(s-1)" is no range: S3 would answer with the whole object
        url = self.url(name)
        pin = {"IfMatch": version} if version else {}

        def fetch() -> bytes:
            with _named(url):
                response = self.client.get_object(
                    Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{end - 1}", **pin
                )
                body = response["Body"].read()
            return whole(body, end - start, start)

        return with_retries(fetch, f"get {url}")

    def list_folder(self, prefix: str) -> tuple[list[str], dict[str, int]]:
        """One "/"-delimited level, page by page (S3-compatible stores do not all list in key order:
        callers sort)."""
        base = self.folder_key(prefix)
        folders, files = [], {}
        with _named(self.url(prefix)):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/", PaginationConfig={"PageSize": LIST_PAGE_KEYS}
            )
            for page in pages:
                folders += [p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
                files.update(
                    {o["Key"][len(base) :]: o["Size"] for o in page.get("Contents", []) if not o["Key"].endswith("/")}
                )  # a folder marker, not an object
        return folders, files

    def walk(self, prefix: str = "") -> dict[str, int]:
        base, shown = self.folder_key(prefix), f"{prefix.rstrip('/')}/" if prefix else ""
        found = {}
        with _named(self.url(prefix)):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                found.update({shown + o["Key"][len(base) :]: o["Size"] for o in page.get("Contents", [])})
        return found

    def delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):
            chunk = [{"Key": self.key(n)} for n in names[start : start + 1000]]
            with _named(self.url(names[start])):
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def abort_uploads(self, prefix: str) -> int:
        """Abort multipart uploads under `prefix` that a dead writer left (they cost storage)."""
        aborted = 0
        with _named(self.url(prefix)):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.key(prefix).rstrip("/") + "/"
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted
