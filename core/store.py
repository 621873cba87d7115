"""The store contract: every byte vitforge reads or writes in a local folder or an object store
goes through a `Store`, found by the URL's scheme.

Implementations: `file://` and plain paths (store_local.py), `s3://` (store_s3.py), `gs://`
(store_gcs.py), `az://` and its alias `abfs://` (store_azure.py). Each is imported on first use,
so a login node that only touches S3 never imports the Google or Azure clients. A user's own
scheme registers with `register_store`, or from another installed package through the entry point
group `vitforge.stores` (name: the scheme; value: "module:opener"), the way Python packages
declare plugins. Any other scheme fsspec knows (http(s)://, memory://, hdfs://, sftp://, hf://)
falls back to a read-only store through fsspec (store_fsspec.py), which refuses every write.

What every implementation guarantees (tests/integration/test_store_contract.py runs one suite against each):
- writes are all or nothing: a reader sees the old object or the whole new one, never a part;
- `put_if` is a compare-and-swap on the object's version (None: create only if absent), raising
  PreconditionFailed when another writer got there first;
- `get_range` and `download` read one version of an object: a download pins the version it
  started on, so an object replaced mid-way fails instead of mixing two versions;
- a missing object raises FileNotFoundError naming its URL; a store that refuses (no bucket, bad
  credentials) raises StorageError in one line naming the URL and the cause, without a secret;
  a transfer cut short is retried within the bounds of retry.py;
- a "folder" is no object: a write into one lands whatever other writers delete or tidy meanwhile
  (a local store makes a folder again that another writer removed once it was empty).
Credentials come from each cloud's standard chain, never from a URL, a config or our arguments: a
URL with a query string, a password or a `..` segment is refused before any store opens (urls.py).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import itertools
import os
import shutil
import socket
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

from . import registry
from .errors import StorageError, UsageError
from .files import PARTIAL_MARK
from .retry import TransientError
from .urls import check_store_url

ENTRY_POINT_GROUP = "vitforge.stores"
# Parts (blocks) of one file an object store uploads at once, per rank: enough for a remote store's
# bandwidth, few enough that an upload in the background takes little from training.
UPLOAD_THREADS = 4


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    version: str  # what a pinned read compares against: an ETag, a generation, a local file's identity


@runtime_checkable
class Store(Protocol):
    """A folder of named objects ("a/b.tar": names use "/" whatever the store). Per rank: one
    client and its connection pool (32 connections at most), nothing that grows with the data.

    Optional attribute `requests: int`: the requests this store has sent, its client's own retries
    included (what the store bills). The node cache reports it as what reading cost; a store
    without it counts as 0 (a local folder sends none)."""

    def url(self, name: str) -> str:
        """The object's full URL (or local path), for messages and for other tools."""

    def temp_path(self, name: str) -> str:
        """A local path to write `name` before `put_file`; its writer's host and pid are in it."""

    def put_file(self, local_path: str, name: str, keep: bool = False) -> str | None:
        """Move (with `keep`: copy) a local file in, all or nothing; large files in parallel parts.
        Returns the sha256 of the bytes sent where the store hashes them as it reads them (S3),
        else None (the caller hashes the file itself when it needs the sum)."""

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write a small object whole, replacing any."""

    def get_bytes(self, name: str) -> bytes:
        """The whole object; FileNotFoundError when absent."""

    def get_range(self, name: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes [start, end); with `version`, PreconditionFailed if the object is no longer it."""

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        """(bytes, version) or None when absent: what `put_if` compares against."""

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        """Write only if the object is still at `version` (None: only if absent); the new version.
        `version` comes from `get_versioned` or an earlier `put_if` (a local store's differs from
        `stat`'s: the sha256 of its bytes, where stat must not read a 2 GB file)."""

    def stat(self, name: str) -> ObjectInfo:
        """Size and version; FileNotFoundError when absent."""

    def download(
        self, name: str, local_path: str, part_bytes: int = 16 << 20, threads: int = 8, length: int | None = None
    ) -> str:
        """Copy to a local file in parallel ranged reads of one version; the sha256 of the bytes.
        `length`: only the first `length` bytes, without pinning a version."""

    def exists(self, name: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """The objects directly in the folder `prefix` ("prefix/name"), sorted."""

    # (builtins.list: in the class body below `def list`, a bare `list` names that method)
    def list_folder(self, prefix: str) -> tuple[builtins.list[str], dict[str, int]]:
        """One folder level: (subfolder names, {object name: size}), names relative to `prefix`."""

    def walk(self, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix`, recursively, with its size; temporaries left out."""

    def delete(self, names: builtins.list[str]) -> None:
        """Remove objects; absent ones are not an error."""

    def abort_uploads(self, prefix: str) -> int:
        """Discard what dead writers left under `prefix` (unfinished uploads); how many."""

    def local_copy(self, name: str, folder: str) -> str:
        """A local file holding the object (the object itself when the store is local)."""

    def local_path(self, name: str) -> str | None:
        """Where the object already lies on this machine, or None."""

    def discard_stale_temporaries(self, names: set[str]) -> None:
        """Remove the temporaries of `names`, and any other whose writer on this host is gone."""

    def finish(self) -> None:
        """Tidy what this writer's work left (its temporary folder) once it is done."""


Opener = Callable[[str, str], Store]  # (url, local work folder) -> Store
_BUILTIN = {
    "file": "vitforge.core.store_local:open_local",
    "s3": "vitforge.core.store_s3:open_s3",
    "s3a": "vitforge.core.store_s3:open_s3",
    "gs": "vitforge.core.store_gcs:open_gcs",
    "gcs": "vitforge.core.store_gcs:open_gcs",
    "az": "vitforge.core.store_azure:open_azure",
    "abfs": "vitforge.core.store_azure:open_azure",
    "abfss": "vitforge.core.store_azure:open_azure",
}
FSSPEC_FALLBACK = "vitforge.core.store_fsspec:open_fsspec"  # read-only, for any other scheme fsspec knows
_openers: dict[str, Opener | str] = dict(_BUILTIN)
_entry_points_loaded = False


def register_store(scheme: str, opener: Opener | str, clobber: bool = False) -> None:
    """Make `open_store` answer URLs of `scheme` with `opener(url, work_dir)` (or "module:name")."""
    if scheme in _openers and not clobber:
        raise UsageError(f"store scheme {scheme}:// is already registered (pass clobber=True to replace it)")
    _openers[scheme] = opener


def store_schemes() -> list[str]:
    _load_entry_points()
    return sorted(_openers)


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_remote(url: str) -> bool:
    return scheme_of(url) != "file"


def open_store(url: str, work_dir: str = "_work/tmp") -> Store:
    """The store rooted at `url`. `work_dir`: where a local store keeps temporaries (inside the
    store, so renames are atomic); object stores stage on local disk instead."""
    scheme = scheme_of(url)
    check_store_url(url)
    if read_only(url):
        return registry.load(FSSPEC_FALLBACK)(url, work_dir)
    opener = registry.find(
        _openers,
        scheme,
        unknown=lambda known: UsageError(
            f"{url}: no store for {scheme}:// (known: {', '.join(s + '://' for s in known)}, and for reading any "
            f"scheme fsspec knows; a package adds one through the entry point group {ENTRY_POINT_GROUP!r})"
        ),
    )
    return opener(url, work_dir)


def read_only(url: str) -> bool:
    """Whether `url` is read through fsspec (no store of its own): then nothing may be written there."""
    scheme = scheme_of(url)
    if scheme not in _openers:
        _load_entry_points()
    return scheme not in _openers and _fsspec_knows(scheme)


def read_only_error(url: str) -> UsageError:
    """The refusal of a write to a store `read_only` says is one, naming the scheme and what it lacks."""
    return UsageError(
        f"{url}: {scheme_of(url)}:// is read through fsspec, which offers no all-or-nothing write "
        "and no compare-and-swap (what checkpoints, the lease and sharder outputs need): write to a "
        "local folder, s3://, gs:// or az:// instead"
    )


def _fsspec_knows(scheme: str) -> bool:
    """Whether fsspec has a filesystem for `scheme` (its package may still be missing: the opener says)."""
    from fsspec.registry import known_implementations
    from fsspec.registry import registry as loaded

    return scheme in known_implementations or scheme in loaded


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """("bucket", "key/prefix") of scheme://bucket/key/prefix; a URL without a bucket is refused."""
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    if not bucket:
        raise UsageError(f"{url}: no bucket in the URL")
    return bucket, prefix.strip("/")


_object_stores: dict[str, Store] = {}
_object_stores_lock = threading.Lock()


def _forget_clients() -> None:
    """A forked worker (the sharder's) must not share its parent's clients: their pooled connections
    would carry two processes' requests at once. The lock is new too: another thread may have held it."""
    global _object_stores_lock
    _object_stores.clear()
    _object_stores_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients)


def object_store(url: str) -> tuple[Store, str]:
    """(store, name) for one object's URL or path, such as a corpus's image: the store of its
    bucket (or folder), opened once per bucket and kept (per process: one client per bucket)."""
    if not is_remote(url):
        path = os.path.abspath(url.removeprefix("file://"))
        return open_store(os.path.dirname(path)), os.path.basename(path)
    scheme, rest = url.split("://", 1)  # an object's key may hold '?' or '#': only its bucket's URL is checked
    bucket, _, name = rest.partition("/")
    if not name.strip("/"):
        raise IsADirectoryError(f"{url}: a bucket, not an object")  # a bad input, not a failed store
    root = f"{scheme}://{bucket}"
    with _object_stores_lock:
        if root not in _object_stores:
            _object_stores[root] = open_store(root)
        return _object_stores[root], name


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    registry.add_entry_points(_openers, entry_points(group=ENTRY_POINT_GROUP))


def parallel_download(
    store: Store, name: str, local_path: str, part_bytes: int, threads: int, length: int | None
) -> str:
    """`download` for object stores, on top of `get_range`: parts fetched in parallel and written
    in place, hashed in order as they arrive (checking costs no second pass over the file). A part
    cut short is fetched again by get_range; a write that cannot complete raises LocalWriteError.
    Holds at most `threads` parts in memory."""
    if length is None:
        info = store.stat(name)
        size, version = info.size, info.version
    else:
        size, version = length, None
    digest = hashlib.sha256()
    fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def part(start: int) -> bytes:
        data = store.get_range(name, start, min(start + part_bytes, size), version)
        write_all(fd, data, start, local_path)
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


def whole(body: bytes, expected: int, start: int = 0) -> bytes:
    """`body` if it has every byte asked for; a body cut short is a TransientError, for `with_retries`
    to fetch again (botocore and the cloud SDKs do not retry it: docs/ARCHITECTURE.md)."""
    if len(body) != expected:
        raise TransientError(f"short read: {len(body)} of {expected} bytes at {start}")
    return body


@dataclass(kw_only=True)
class StagedStore:
    """What the object stores share, for an implementation to inherit: files are staged on local
    disk and uploaded whole, downloads are parallel ranged reads (`parallel_download`), and no
    object lies on local disk. The store never shows a partial object, so what killed writers left
    is their staging files on this host. The implementation gives `staging_key(name)`, the object's
    "bucket/key", which names its staging file."""

    requests: int = field(default=0, compare=False)
    """HTTP requests this store has sent, the client's own retries included: what the store bills."""
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_request(self, *_, **__) -> None:
        """A client hook, called once per attempt (signatures differ between SDKs)."""
        with self._count_lock:
            self.requests += 1

    def staging_key(self, name: str) -> str:
        raise NotImplementedError

    def key(self, name: str) -> str:
        raise NotImplementedError

    def folder_key(self, prefix: str) -> str:
        """The key prefix that lists the folder `prefix`: "" for the store's root, else ending in "/"."""
        key = self.key(prefix).rstrip("/")
        return f"{key}/" if key else ""

    def temp_path(self, name: str) -> str:
        folder = staging_dir()
        os.makedirs(folder, exist_ok=True)
        return temp_name(folder, self.staging_key(name))

    # (self: Store: a mixin's methods use what the implementation gives, list_folder and stat)
    def list(self: Store, prefix: str) -> list[str]:
        return sorted(f"{prefix.rstrip('/')}/{n}" if prefix else n for n in self.list_folder(prefix)[1])

    def exists(self: Store, name: str) -> bool:
        """Through stat, whose errors are the store's: an SDK's own exists() says False for a
        missing bucket too, which would hide it."""
        try:
            self.stat(name)
            return True
        except FileNotFoundError:
            return False

    def download(
        self: Store, name: str, local_path: str, part_bytes: int = 16 << 20, threads: int = 8, length: int | None = None
    ) -> str:
        return parallel_download(self, name, local_path, part_bytes, threads, length)

    def local_copy(self: Store, name: str, folder: str) -> str:
        path = os.path.join(folder, os.path.basename(name))
        self.download(name, path)
        return path

    def local_path(self, name: str) -> str | None:
        return None

    def discard_stale_temporaries(self, names: set[str]) -> None:
        """The staging files of `names`, and any other whose writer on this host is gone."""
        discard_stale(staging_dir(), {self.staging_key(n) for n in names})

    def finish(self) -> None:
        pass


class LocalWriteError(StorageError):
    """A local file could not be written whole: a full disk, a quota, a file size limit."""


def local_write_error(path: str, e: OSError) -> LocalWriteError:
    """Names the file, the cause and the room left, which is what a full disk needs to be fixed."""
    folder = os.path.dirname(os.path.abspath(path))
    return LocalWriteError(
        f"{path}: {e.strerror or e} ({shutil.disk_usage(folder).free / 1e6:.1f} MB free in {folder})"
    )


def write_all(fd: int, data: bytes, offset: int, path: str) -> None:
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


def staging_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "vitforge-staging")


def temp_name(folder: str, name: str) -> str:
    """Host and pid in the name let a rerun tell a dead writer's leftovers from a live one's; the
    thread, that two threads of a process writing one name do not share a temporary."""
    return os.path.join(
        folder, f"{name.replace('/', '%')}.t{threading.get_ident()}{PARTIAL_MARK}{socket.gethostname()}-{os.getpid()}"
    )


def discard_stale(folder: str, shard_names: set[str]) -> int:
    """Remove what killed writers left: anything of the shards we own (tar, index, record), and
    any other temporary whose writer ran on this host and is gone. Other writers' live files stay."""
    stems = tuple(name.replace("/", "%").removesuffix(".tar") + "." for name in shard_names)
    removed = 0
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:  # another writer that finished removed it empty
        entries = []
    for entry in entries:
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
