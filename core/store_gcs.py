"""Google Cloud Storage (`gs://`, alias `gcs://`) as a Store, through google-cloud-storage.

Small writes are single-request uploads and files above 8 MiB chunked resumable uploads; GCS shows
an object only once its upload is finalised, and checks the upload against the crc32c we send. put_if
is a conditional write on the object's generation (ifGenerationMatch; 0: only if absent); versions
are generations, as strings. Credentials come from Application Default Credentials
(GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, the metadata server); with STORAGE_EMULATOR_HOST set
the client talks to that emulator anonymously. Nothing of a credential reaches a message.

Retries: google's Retry retries 429, 5xx, resets and timeouts; we hand it the bounds of retry.py
(per-attempt connect/read timeouts, at most AWS_MAX_ATTEMPTS attempts, the enclosing operation's
deadline) and log each failed attempt. with_retries is added only for what google does not retry
(a ranged body cut short). Denials (401/403) and a missing bucket are never retried.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from .errors import PreconditionFailed, StorageError, UsageError
from .retry import TransientError, current_operation, past_deadline, store_limits, with_retries, with_retries_if_present
from .store import ObjectInfo, StagedStore, bucket_and_prefix, whole

log = logging.getLogger("vitforge.store")
LIST_PAGE_KEYS = 1000  # objects per listing page (GCS's most): what a listing holds at a time
UPLOAD_CHUNK_BYTES = 64 << 20  # per resumable request: the memory an upload holds, and its restart unit
POOL_CONNECTIONS = 32
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")  # Google's rules; a dotted name's parts <= 63


def open_gcs(url: str, work_dir: str) -> GCSStore:
    try:  # an optional dependency: say how to get it rather than print a traceback
        import google.cloud.storage  # noqa: F401
    except ImportError as e:
        raise UsageError(
            f"gs:// stores need the Google Cloud Storage client ({e.name} is missing): pip install 'vitforge[gcs]'"
        ) from None
    bucket, prefix = bucket_and_prefix(url)
    if not BUCKET_NAME.fullmatch(bucket) or max(len(part) for part in bucket.split(".")) > 63:
        raise UsageError(
            f"{url}: {bucket!r} is not a bucket name (3-63 lower-case letters, digits, '-', '_' and "
            "'.', starting and ending with a letter or digit)"
        )
    return GCSStore(bucket, prefix)


@dataclass
class GCSStore(StagedStore):
    """Per rank: one client with a pool of at most 32 connections, created on first use."""

    bucket: str
    prefix: str
    _client: object = field(default=None, repr=False)
    _client_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _bucket_seen: bool = field(default=False, repr=False, compare=False)

    @property
    def client(self):
        with self._client_lock:
            if self._client is None:
                self._client = _make_client(self)
        return self._client

    def _blob(self, name: str, generation: str | None = None):
        return self.client.bucket(self.bucket).blob(self.key(name), generation=int(generation) if generation else None)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}".strip("/") if self.prefix else name

    def url(self, name: str) -> str:
        return f"gs://{self.bucket}/{self.key(name)}"

    def _call(self, url: str, what: str, requests: int = 1) -> dict:
        """The bounds google's methods take: (connect, read) timeouts per attempt, and a Retry for
        the `requests` requests the call makes."""
        return {"timeout": _timeouts(), "retry": _retry(f"{what} {url}", requests)}

    @contextlib.contextmanager
    def _named(self, url: str):
        """google's errors name the request, not the object, and a missing bucket reads like a
        missing object: say which gs:// URL failed, and why, in one line, without any credential."""
        from google.api_core import exceptions as api
        from google.auth.exceptions import DefaultCredentialsError, RefreshError, TransportError
        from google.cloud.storage.exceptions import DataCorruption

        try:
            yield
            self._bucket_seen = True
        except api.NotFound:
            if not self._bucket_seen:
                self._check_bucket(url)
            raise FileNotFoundError(f"{url}: no such object") from None
        except api.PreconditionFailed:
            raise PreconditionFailed(f"{url}: changed by another writer") from None
        except (api.Unauthorized, api.Forbidden) as e:
            raise StorageError(
                f"{url}: {e.code} {_reason(e)}: access refused (credentials come from "
                "GOOGLE_APPLICATION_CREDENTIALS or Application Default Credentials)"
            ) from None
        except DefaultCredentialsError as e:
            raise StorageError(f"{url}: {_credentials_problem(e)}") from None
        except RefreshError as e:
            raise StorageError(f"{url}: the Google credentials were refused: {_first_line(e)}") from None
        except DataCorruption as e:
            raise TransientError(f"{url}: checksum mismatch: {_first_line(e)}") from None
        except (api.GoogleAPICallError, TransportError, ConnectionError) as e:
            raise StorageError(f"{url}: {type(e).__name__}: {_first_line(e)}") from None

    def _check_bucket(self, url: str) -> None:
        """Once per store, on the first 404: was it the object or the whole bucket?"""
        try:
            exists = self.client.bucket(self.bucket).exists(**self._call(url, "bucket"))
        except Exception:
            return
        if not exists:
            raise StorageError(f"{url}: no bucket gs://{self.bucket} (create it, or check the URL)")
        self._bucket_seen = True

    def staging_key(self, name: str) -> str:
        return f"{self.bucket}/{self.key(name)}"

    def put_file(self, local_path: str, name: str, keep: bool = False) -> None:
        """Up to 8 MiB in one request, larger in a resumable upload of 64 MiB requests, each retried;
        the last one carries the whole file's crc32c (x-goog-hash), which GCS checks before it
        publishes the object."""
        url = self.url(name)
        requests = 1 + -(-os.path.getsize(local_path) // UPLOAD_CHUNK_BYTES)  # the session's start, then each part

        def upload() -> None:  # again from the start only if the checksums disagreed at the end
            with self._named(url):
                blob = self._blob(name)
                blob.chunk_size = UPLOAD_CHUNK_BYTES
                blob.upload_from_filename(local_path, checksum="crc32c", **self._call(url, "upload", requests))

        with_retries(upload, f"upload {url}")
        if not keep:
            os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        with self._named(self.url(name)):
            self._blob(name).upload_from_string(data, checksum="crc32c", **self._call(self.url(name), "put"))

    def get_bytes(self, name: str) -> bytes:
        """The whole object, checked against its stored checksum (a mismatch is fetched again)."""

        def fetch() -> bytes:
            with self._named(self.url(name)):
                return self._blob(name).download_as_bytes(checksum="auto", **self._call(self.url(name), "get"))

        return with_retries(fetch, f"get {self.url(name)}")

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        def fetch():
            with self._named(self.url(name)):
                blob = self._blob(name)
                data = blob.download_as_bytes(checksum="auto", **self._call(self.url(name), "get"))
            return data, str(blob.generation)  # from the download's own headers: the bytes' generation

        return with_retries_if_present(fetch, f"get {self.url(name)}")

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        """ifGenerationMatch: 0 when it must be absent, else the generation it was read at."""
        with self._named(self.url(name)):
            blob = self._blob(name)
            blob.upload_from_string(
                data,
                checksum="crc32c",
                if_generation_match=int(version) if version else 0,
                **self._call(self.url(name), "put"),
            )
        return str(blob.generation)

    def stat(self, name: str) -> ObjectInfo:
        with self._named(self.url(name)):
            blob = self.client.bucket(self.bucket).get_blob(self.key(name), **self._call(self.url(name), "stat"))
            if blob is None:
                raise _not_found()
        return ObjectInfo(blob.size, str(blob.generation))

    def get_range(self, name: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes [start, end) in one ranged GET (google's `end` is inclusive). With `version`, of
        that generation only: a replaced object fails rather than mixing two versions."""
        if end <= start:
            return b""
        url = self.url(name)
        pin = {"if_generation_match": int(version)} if version else {}

        def fetch() -> bytes:
            try:
                with self._named(url):
                    # The generation in the URL pins the bytes even where ifGenerationMatch on a read is
                    # ignored (fake-gcs-server); GCS then answers 404 for a replaced object.
                    body = self._blob(name, version).download_as_bytes(
                        start=start, end=end - 1, checksum=None, **pin, **self._call(url, "get")
                    )
            except FileNotFoundError:
                if version and self.exists(name):
                    raise PreconditionFailed(f"{url}: changed by another writer (was generation {version})") from None
                raise
            return whole(body, end - start, start)

        return with_retries(fetch, f"get {url}")

    def list_folder(self, prefix: str) -> tuple[list[str], dict[str, int]]:
        """One "/"-delimited level, 1000 objects a page."""
        base = self.folder_key(prefix)
        files = {}
        with self._named(self.url(prefix)):
            pages = self.client.list_blobs(
                self.bucket,
                prefix=base,
                delimiter="/",
                page_size=LIST_PAGE_KEYS,
                **self._call(self.url(prefix), "list"),
            )
            for blob in pages:
                if not blob.name.endswith("/"):  # a folder marker, not an object
                    files[blob.name[len(base) :]] = blob.size
            folders = [p[len(base) :].rstrip("/") for p in pages.prefixes]
        return sorted(folders), files

    def walk(self, prefix: str = "") -> dict[str, int]:
        base = self.folder_key(prefix)
        shown = f"{prefix.rstrip('/')}/" if prefix else ""
        with self._named(self.url(prefix)):
            return {
                shown + blob.name[len(base) :]: blob.size
                for blob in self.client.list_blobs(
                    self.bucket, prefix=base, page_size=LIST_PAGE_KEYS, **self._call(self.url(prefix), "list")
                )
            }

    def delete(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError), self._named(self.url(name)):
                self.client.bucket(self.bucket).delete_blob(self.key(name), **self._call(self.url(name), "delete"))

    def abort_uploads(self, prefix: str) -> int:
        """Nothing to do: an unfinished resumable upload is invisible, costs nothing and GCS drops
        its session after a week by itself."""
        return 0


def _make_client(store: GCSStore):
    """A client of the standard credential chain (anonymous for an emulator), every connection
    through one bounded, counting pool."""
    import requests.adapters
    from google.cloud import storage

    class CountingAdapter(requests.adapters.HTTPAdapter):
        def send(self, *args, **kwargs):
            store.count_request()
            return super().send(*args, **kwargs)

    client = storage.Client()  # the project, where one is needed, also from the standard chain
    adapter = CountingAdapter(pool_connections=POOL_CONNECTIONS, pool_maxsize=POOL_CONNECTIONS, max_retries=0)
    client._http.mount("https://", adapter)  # the client's own session (google's auth stays on it)
    client._http.mount("http://", adapter)
    return client


def _timeouts() -> tuple[float, float]:
    limits = store_limits()
    return limits.connect_timeout_s, limits.read_timeout_s


def _retry(what: str, requests: int = 1):
    """google's Retry within retry.py's bounds: the enclosing operation's deadline (or one of its
    own), at most `attempts` attempts per request, a log line per failed attempt. google shares one
    Retry among a call's requests (a resumable upload's parts) and tells it only of failures, so the
    attempts are counted over the call: (attempts - 1) failures per request it makes."""
    from google.api_core.retry import Retry
    from google.cloud.storage.retry import DEFAULT_RETRY

    limits = store_limits()
    enclosing = current_operation()
    deadline = enclosing.deadline if enclosing else time.monotonic() + limits.deadline_s
    attempts = [0]
    allowed = requests * (limits.attempts - 1)

    def failed(error: Exception) -> None:
        attempts[0] += 1
        cause = f"{type(error).__name__}: {_first_line(error)}"
        if attempts[0] > allowed:
            raise StorageError(f"{what}: failed after {attempts[0]} attempts: {cause}")
        if time.monotonic() >= deadline:
            raise past_deadline(what, attempts[0], cause)
        log.warning(
            "%s: attempt failed (%d of at most %d failures): %s; %.1f s left before the deadline",
            what,
            attempts[0],
            allowed,
            cause,
            deadline - time.monotonic(),
        )

    # DEFAULT_RETRY's predicate is google's list of what is worth another try (429, 5xx, resets). No
    # timeout of google's own: `failed` gives up at the first failure after our deadline.
    return Retry(
        predicate=DEFAULT_RETRY._predicate, initial=0.2, maximum=10, multiplier=2, timeout=None, on_error=failed
    )


def _credentials_problem(error: Exception) -> str:
    """Why Application Default Credentials failed: the file GOOGLE_APPLICATION_CREDENTIALS names and
    what is wrong with it when it is set (never its contents), else that none were found."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        return (
            "no Google credentials found (set GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth "
            "application-default login`, or run where a metadata server is)"
        )
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return f"GOOGLE_APPLICATION_CREDENTIALS names {path}, which does not exist"
    except OSError as e:
        return f"GOOGLE_APPLICATION_CREDENTIALS names {path}, which cannot be read ({e.strerror})"
    try:
        info = json.loads(text)
    except ValueError:
        return (
            f"GOOGLE_APPLICATION_CREDENTIALS names {path}, which is not JSON (a service-account key or "
            "`gcloud auth application-default login`'s file is)"
        )
    if not isinstance(info, dict) or "type" not in info:
        return f"GOOGLE_APPLICATION_CREDENTIALS names {path}, a JSON file with no 'type': not a Google credentials file"
    cause = error.__cause__ or error  # google names the file in its own line; the detail is the cause's
    return f"GOOGLE_APPLICATION_CREDENTIALS names {path}, which Google's client refused: {_first_line(cause)}"


def _not_found():
    from google.api_core import exceptions as api

    return api.NotFound("no such object")


def _reason(e) -> str:
    return getattr(e, "reason", None) or e.message.split(":")[0]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
