"""Where shards go: a local folder or an object store, with all-or-nothing writes.

Local writes land under a temporary name in the same folder and are renamed into place; object
store writes are single PUTs or multipart uploads, which S3 makes visible only when complete.
Endpoint, region and credentials come from the standard AWS chain (AWS_ENDPOINT_URL,
AWS_PROFILE, ...), never from our arguments, so no secret reaches a log line or a manifest.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from dataclasses import dataclass, field

from .retry import with_retries


def open_store(url: str) -> "LocalStore | S3Store":
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"{url}: no bucket in the URL")
        return S3Store(bucket, prefix.strip("/"))
    if "://" in url and not url.startswith("file://"):
        raise ValueError(f"{url}: only local folders, file:// and s3:// destinations are supported")
    return LocalStore(os.path.abspath(url.removeprefix("file://")))


TEMP_MARK = ".partial-"


@dataclass
class LocalStore:
    """A folder. Every write goes to _work/tmp/ first (same filesystem) and is renamed into place."""

    root: str

    def url(self, name: str) -> str:
        return os.path.join(self.root, name)

    def temp_path(self, name: str) -> str:
        return _temp_name(self._temp_dir(), name)

    def put_file(self, local_path: str, name: str) -> None:
        os.makedirs(os.path.dirname(self.url(name)), exist_ok=True)
        os.replace(local_path, self.url(name))

    def put_bytes(self, name: str, data: bytes) -> None:
        tmp = self.temp_path(name)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self.put_file(tmp, name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get_bytes(self, name: str) -> bytes:
        with open(self.url(name), "rb") as f:
            return f.read()

    def exists(self, name: str) -> bool:
        return os.path.exists(self.url(name))

    def list(self, prefix: str) -> list[str]:
        folder = self.url(prefix)
        if not os.path.isdir(folder):
            return []
        return sorted(os.path.join(prefix, n) for n in os.listdir(folder))

    def local_copy(self, name: str, folder: str) -> str:
        return self.url(name)

    def discard_stale_temporaries(self, shard_names: set[str]) -> None:
        _discard_stale(self._temp_dir(), shard_names)

    def finish(self) -> None:
        try:
            os.rmdir(self._temp_dir())
        except OSError:
            pass  # another part is still writing there

    def _temp_dir(self) -> str:
        folder = os.path.join(self.root, "_work", "tmp")
        os.makedirs(folder, exist_ok=True)
        return folder


@contextlib.contextmanager
def _named(url: str):
    """botocore's errors name the endpoint, not the object: say which s3:// URL failed."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code"))
        if code in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"{url}: no such object") from None
        raise OSError(f"{url}: {e}") from None
    except BotoCoreError as e:
        raise OSError(f"{url}: {e}") from None


def _temp_name(folder: str, name: str) -> str:
    """Host and pid in the name let a rerun tell a dead writer's leftovers from a live one's."""
    return os.path.join(folder, f"{name.replace('/', '%')}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}")


def _discard_stale(folder: str, shard_names: set[str]) -> None:
    """Remove what killed writers left: anything of the shards we own (tar, index, record), and
    any other temporary whose writer ran on this host and is gone. Other parts' live files stay."""
    stems = tuple(name.replace("/", "%").removesuffix(".tar") + "." for name in shard_names)
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        base, _, writer = entry.partition(TEMP_MARK)
        host, _, pid = writer.rpartition("-")
        ours = any(stem in base for stem in stems)
        if ours or (host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))):
            os.unlink(os.path.join(folder, entry))


def _alive(pid: int) -> bool:
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

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            # botocore retries throttling, 5xx and resets itself; our own retry wraps only what it
            # does not (a body cut short), so the two never multiply into minutes of waiting.
            # The standard AWS_MAX_ATTEMPTS / AWS_RETRY_MODE variables still win over our defaults.
            retries = {"mode": os.environ.get("AWS_RETRY_MODE", "standard"),
                       "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", "8"))}
            self._client = boto3.client("s3", config=Config(retries=retries, connect_timeout=10, read_timeout=120))
        return self._client

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def temp_path(self, name: str) -> str:
        """Shards are staged on local disk, then uploaded whole."""
        return _temp_name(self._staging, f"{self.bucket}/{self.key(name)}")

    @property
    def _staging(self) -> str:
        folder = os.path.join(tempfile.gettempdir(), "vitforge-staging")
        os.makedirs(folder, exist_ok=True)
        return folder

    def put_file(self, local_path: str, name: str) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)
        with _named(self.url(name)):
            self.client.upload_file(local_path, self.bucket, self.key(name), Config=config)
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
                # A body cut short is not retried by botocore (DESIGN.md section 4).
                raise OSError(f"short read: {len(body)} of {response['ContentLength']} bytes")
            return body

        return with_retries(fetch, f"get {self.url(name)}")

    def exists(self, name: str) -> bool:
        try:
            with _named(self.url(name)):
                self.client.head_object(Bucket=self.bucket, Key=self.key(name))
            return True
        except FileNotFoundError:
            return False

    def list(self, prefix: str) -> list[str]:
        names = []
        base = self.key(prefix).rstrip("/") + "/"
        with _named(self.url(prefix)):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                names += [prefix.rstrip("/") + "/" + o["Key"][len(base):] for o in page.get("Contents", [])]
        return sorted(names)

    def local_copy(self, name: str, folder: str) -> str:
        path = os.path.join(folder, os.path.basename(name))
        with _named(self.url(name)):
            self.client.download_file(self.bucket, self.key(name), path)
        return path

    def discard_stale_temporaries(self, names: set[str]) -> None:
        """Nothing to do: S3 never shows a partial object, and stale staging files are in $TMPDIR."""

    def finish(self) -> None:
        pass
