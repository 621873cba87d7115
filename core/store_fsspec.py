"""Any filesystem fsspec knows (http(s)://, memory://, hdfs://, sftp://, hf://, ftp://, ...) as a
read-only Store: the fallback for every scheme without a store of its own (core/store.py).

What it serves is what reads: sharder sources and manifests, shards and their .idx for the loader
(the node cache downloads whole shards as it does from s3), `vitforge shard verify`. Writes are
refused in one line naming the scheme and what it lacks: fsspec promises neither an all-or-nothing
write nor a compare-and-swap, and checkpoints, the lease and sharder outputs are built on both.
A command that writes meets the refusal at its first write, which for the sharder (its plan claim)
and the trainer (the lease) is the first thing it does.

Versions: what the filesystem reports of an object (ETag, else Last-Modified or mtime, with the
size). A pinned read (`get_range` with a version, hence `download`) asks for it again after each
part and raises PreconditionFailed when it changed: one metadata request per part (16 MiB in a
download). An HTTP server must answer byte ranges: one that sends the whole object instead is
refused by name rather than read whole for every part.

Retries and bounds: every call runs under with_retries (retry.py's deadline); an absent object
(404/410) and a refusal (401/403) fail at once, connection errors, timeouts, 408, 429 and 5xx are
retried. HTTP requests carry retry.py's connect and read timeouts; other filesystems' clients keep
their own.

Cost per rank: one filesystem instance per scheme and process (fsspec's), its client's connection
pool; a listing of an HTTP folder asks each listed object's size (a HEAD each), since an HTML
index carries none.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from .errors import PreconditionFailed, StorageError, UsageError
from .retry import TransientError, store_limits, with_retries
from .store import ObjectInfo, StagedStore, read_only_error, scheme_of, whole


def open_fsspec(url: str, work_dir: str) -> FsspecStore:
    import fsspec

    scheme = scheme_of(url)
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:  # fsspec names the package the scheme needs
        raise UsageError(f"{url}: {scheme}:// needs a package that is not installed: {e}") from None
    store = FsspecStore(url.rstrip("/"))
    store.root = store.fs._strip_protocol(store.base).rstrip("/")
    return store


def _options(scheme: str) -> dict:
    """The filesystem's arguments: for HTTP, retry.py's per-attempt timeouts (aiohttp's default is
    five minutes per request)."""
    if scheme not in ("http", "https"):
        return {}
    import aiohttp

    limits = store_limits()
    return {
        "client_kwargs": {
            "timeout": aiohttp.ClientTimeout(connect=limits.connect_timeout_s, sock_read=limits.read_timeout_s)
        }
    }


@dataclass
class FsspecStore(StagedStore):
    """Per rank: one fsspec filesystem per process (a forked worker makes its own)."""

    base: str  # the store's URL
    root: str = ""  # the filesystem's path of `base`
    _fs: object = field(default=None, repr=False, compare=False)
    _pid: int = field(default=0, repr=False, compare=False)
    _fs_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def scheme(self) -> str:
        return scheme_of(self.base)

    @property
    def fs(self):
        with self._fs_lock:
            if self._fs is None or self._pid != os.getpid():
                import fsspec

                self._fs, self._pid = fsspec.filesystem(self.scheme, **_options(self.scheme)), os.getpid()
        return self._fs

    def path(self, name: str) -> str:
        return f"{self.root}/{name}".rstrip("/") if name else self.root

    def url(self, name: str) -> str:
        return f"{self.base}/{name}" if name else self.base

    def staging_key(self, name: str) -> str:
        return f"{self.scheme}%{self.url(name).split('://', 1)[1]}"

    def _call(self, fn, name: str, what: str):
        url = self.url(name)

        def attempt():
            self.count_request()
            try:
                return fn()
            except Exception as e:  # fsspec's clients raise their own types: sorted by _failure
                raise _failure(e, url) from None

        return with_retries(attempt, f"{what} {url}")

    # -- reads -------------------------------------------------------------------------------
    def get_bytes(self, name: str) -> bytes:
        return self._call(lambda: self.fs.cat_file(self.path(name)), name, "read")

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        try:
            info = self.stat(name)
            return self.get_range(name, 0, info.size, info.version), info.version
        except FileNotFoundError:
            return None

    def stat(self, name: str) -> ObjectInfo:
        info = self._call(lambda: self.fs.info(self.path(name)), name, "stat")
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{self.url(name)}: a folder, not an object")
        if info.get("size") is None:
            raise StorageError(f"{self.url(name)}: the server does not say the object's size")
        return ObjectInfo(int(info["size"]), _version(info))

    def get_range(self, name: str, start: int, end: int, version: str | None = None) -> bytes:
        if end <= start:
            return b""

        def fetch() -> bytes:
            data = self.fs.cat_file(self.path(name), start=start, end=end)
            if len(data) > end - start:
                raise StorageError(
                    f"{self.url(name)}: the server sent {len(data)} bytes for a range of "
                    f"{end - start}: it does not answer byte ranges (Range requests), which reading "
                    "shards needs"
                )
            return whole(data, end - start, start)

        data = self._call(fetch, name, f"read bytes {start}-{end} of")
        if version is not None and self.stat(name).version != version:
            raise PreconditionFailed(f"{self.url(name)}: changed while it was read")
        return data

    def list_folder(self, prefix: str) -> tuple[list[str], dict[str, int]]:
        folder = self.path(prefix)
        try:
            entries = self._call(lambda: self.fs.ls(folder, detail=True), prefix, "list")
        except FileNotFoundError:
            return [], {}
        folders, objects = [], {}
        for entry in entries:
            relative = _relative(entry["name"], folder)
            if not relative or relative in ("..", "."):
                continue
            if entry.get("type") == "directory":
                folders.append(relative.rstrip("/"))
            else:
                size = entry.get("size")
                objects[relative] = int(size) if size is not None else self.stat(_under(prefix, relative)).size
        return sorted(folders), dict(sorted(objects.items()))

    def walk(self, prefix: str = "") -> dict[str, int]:
        folders, objects = self.list_folder(prefix)
        found = {_under(prefix, n): size for n, size in objects.items()}
        for sub in folders:
            found.update(self.walk(_under(prefix, sub)))
        return dict(sorted(found.items()))

    def abort_uploads(self, prefix: str) -> int:
        return 0  # nothing is ever uploaded here

    # -- writes: refused ----------------------------------------------------------------------
    def _read_only(self, name: str) -> UsageError:
        return read_only_error(self.url(name))

    def put_file(self, local_path: str, name: str, keep: bool = False) -> str | None:
        raise self._read_only(name)

    def put_bytes(self, name: str, data: bytes) -> None:
        raise self._read_only(name)

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        raise self._read_only(name)

    def delete(self, names: list[str]) -> None:
        raise self._read_only(names[0] if names else "")


def _under(prefix: str, name: str) -> str:
    """The store name of `name` in the folder `prefix` ("" is the store's root)."""
    return f"{prefix.rstrip('/')}/{name}" if prefix else name


def _relative(path: str, folder: str) -> str:
    """`path` (as the filesystem lists it: a full URL for HTTP) relative to `folder`."""
    path, folder = path.rstrip("/"), folder.rstrip("/")
    if path.startswith(folder + "/"):
        return path[len(folder) + 1 :]
    return path.rsplit("/", 1)[-1]


def _version(info: dict) -> str:
    for key in ("ETag", "etag", "Last-Modified", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return f"{info[key]}:{info.get('size')}"
    return f"size:{info.get('size')}"


def _failure(error: Exception, url: str) -> Exception:
    """One of the store contract's errors for what fsspec's client raised: FileNotFoundError
    (absent), StorageError (refused: never retried), TransientError (retried), or the error itself
    (a UsageError, a PreconditionFailed)."""
    if isinstance(error, (StorageError, UsageError)):
        return error
    cause = error.__cause__ if isinstance(error, FileNotFoundError) and error.__cause__ is not None else error
    status = getattr(cause, "status", None)
    if isinstance(cause, (FileNotFoundError, KeyError)) or status in (404, 410):  # memory:// raises KeyError
        return FileNotFoundError(f"{url}: no such object")
    if status in (401, 403) or isinstance(cause, PermissionError):
        return StorageError(f"{url}: access refused ({status or type(cause).__name__})")
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return StorageError(f"{url}: the server answered {status}")
    return TransientError(f"{url}: {type(cause).__name__}: {cause}")
