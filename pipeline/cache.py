"""A node's shard cache: shards of an object-store dataset fetched whole, in large ranged GETs, onto
node-local disk, shared by every rank of the node and their loader workers, then read by offset.

One folder per node and dataset. A shard is fetched by one process while the others wait on its
lock (flock: the kernel releases it if that process dies), written under a partial name and renamed
when whole. The folder is bounded: to make room, the shards the node's order needs last (first
those it needs no more this epoch) are removed; a reader that still has one open keeps reading it
(an unlinked file lives while open).

What the cache guarantees: a file enters it only after its size and sha256 match dataset.json,
hashed in order as the parts arrive (no second pass); then a marker beside it records the file's
identity (inode, size, mtime, ctime). Opening a cached shard compares the file with its marker:
one fstat and one small read, about 40 us (measured here), instead of rehashing (sha256 runs at
0.7-1 GB/s per core: about 4 s for a 3.3 GB shard, at every open by each of a node's ranks and
loader workers). Any change made through the
filesystem since the check (truncation, rewritten or edited bytes, even with the mtime put back)
moves the ctime, so a changed file, or one without a marker, is evicted and fetched again, once:
if the store's bytes then fail the check, the error names the cache file and the object. Not
caught: corruption below the filesystem (a disk returning wrong bytes without an error), a change
within the same tick of the filesystem's clock as the check, and a change made while a reader
already has the file open. Tars without dataset.json have no sha256: only their size is checked.

A full disk (or quota) fails a fetch cleanly: the partial file is removed, one warning names the
folder and its free space, and that reader reads its uncached shards from the store instead, one
ranged GET per sample (slower, but every sample arrives). What killed fetches left is removed
when the next reader starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable

from vitforge.core import LocalWriteError, S3Store, StorageError, local_write_error, open_store

from .spec import LoaderSpec

log = logging.getLogger("vitforge.pipeline")
PARTIAL = ".partial"
LOCK = ".lock"
CHECKED = ".checked"  # the marker: the identity of the file whose size and sha256 were checked
NEVER = math.inf


@dataclass
class CacheSpec:
    folder: str  # this node's folder for this dataset
    limit_bytes: int
    block_bytes: int  # bytes per ranged GET
    ahead: int  # shards fetched ahead of the one being read, per reader


def cache_spec(spec: LoaderSpec, node: int) -> CacheSpec:
    """This node's cache folder for the spec's dataset: ROOT/nodeN/DATASET-HASH. The node number
    keeps nodes apart even when their ranks run on one host (a test, or a shared temp folder)."""
    root = spec.cache_dir or os.environ.get("VITFORGE_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                                "vitforge-cache")
    dataset = hashlib.sha1(spec.dataset.encode()).hexdigest()[:12]
    return CacheSpec(os.path.join(root, f"node{node}", dataset), int(spec.cache_gb * 1e9),
                     int(spec.read_block_mb * 2**20),
                     spec.shards_ahead)


def shard_file_name(url: str, length: int, sha256: str | None) -> str:
    """Unique per shard URL, content (when the manifest gives its sha256) and byte count; readable:
    'train-000012.tar-3f2a9c1b0e4d-104857600'."""
    tag = hashlib.sha1(f"{url} {sha256}".encode()).hexdigest()[:12]
    return f"{os.path.basename(url)}-{tag}-{length}"


@contextlib.contextmanager
def locked(path: str, blocking: bool = True):
    """An exclusive flock on `path`; yields False (and holds nothing) when not blocking and taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


@dataclass
class ShardFile:
    """A cached (or local) shard, read by offset."""
    fd: int

    def pread(self, length: int, offset: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class StreamedShard:
    """A shard the node's disk cannot hold, read from the store: one ranged GET per read."""
    store: S3Store
    key: str
    counted: Callable[[int], None]

    def pread(self, length: int, offset: int) -> bytes:
        data = self.store.get_range(self.key, offset, offset + length)
        self.counted(len(data))
        return data

    def close(self) -> None:
        pass


class ShardCache:
    """`next_use(file name)`: the node-order position at which the node next reads that shard
    (NEVER when not again this epoch); it decides what to remove when the folder is full."""

    def __init__(self, spec: CacheSpec, next_use: Callable[[str], float]):
        self.spec, self.next_use = spec, next_use
        os.makedirs(spec.folder, exist_ok=True)
        self._stores: dict[str, S3Store] = {}
        self._lock = threading.Lock()
        self.opens = self.fetches = self.bytes_fetched = 0
        self._warned = False
        self._disk_full = False  # once a fetch could not be written, this reader streams what is not cached
        with locked(os.path.join(spec.folder, ".room" + LOCK)):
            for entry in os.scandir(spec.folder):
                if entry.name.endswith(PARTIAL):
                    self._partial_size_or_discard(entry)

    @property
    def requests(self) -> int:
        with self._lock:
            return sum(store.requests for store in self._stores.values())

    def open(self, url: str, length: int, sha256: str | None) -> ShardFile | StreamedShard:
        """The shard's first `length` bytes: its checked cached file (fetched if absent or changed),
        or, when the node's disk cannot hold it, its byte ranges straight from the store."""
        with self._lock:
            self.opens += 1
        name = shard_file_name(url, length, sha256)
        fd = _open_checked(os.path.join(self.spec.folder, name))
        if fd is None:
            fd = self._fetch(url, length, sha256, name)
        if fd is None:
            store, key = self._store_for(url)
            return StreamedShard(store, key, self._count_bytes)
        return ShardFile(fd)

    def prefetch(self, url: str, length: int, sha256: str | None) -> None:
        name = shard_file_name(url, length, sha256)
        fd = _open_checked(os.path.join(self.spec.folder, name))
        if fd is None:
            fd = self._fetch(url, length, sha256, name)
        if fd is not None:
            os.close(fd)

    def _fetch(self, url: str, length: int, sha256: str | None, name: str) -> int | None:
        """Under the shard's lock: a descriptor of the checked file, fetched unless another process
        made it while we waited; a changed copy is evicted first. None when the disk cannot hold it."""
        final = os.path.join(self.spec.folder, name)
        with locked(final + LOCK):
            fd = _open_checked(final)
            if fd is not None:
                return fd
            evicted = _remove(final)
            if evicted:
                log.warning("shard cache: %s is not what its fetch checked (changed since, or never checked); "
                            "removed, fetching %s again", final, url)
            if self._disk_full:
                return None
            partial = final + PARTIAL
            fd = None
            try:
                self._make_room(length, self.next_use(name), partial)
                store, key = self._store_for(url)
                digest = store.download(key, partial, part_bytes=self.spec.block_bytes,
                                        threads=max(1, min(8, -(-length // self.spec.block_bytes))), length=length)
                if sha256 is not None and digest != sha256:
                    again = " (fetched again after the cached copy failed its check)" if evicted else ""
                    raise StorageError(f"{url}: the object differs from dataset.json (its first {length} bytes hash "
                                       f"to {digest}, not {sha256}); not cached as {final}{again}")
                fd = os.open(partial, os.O_RDONLY)  # the inode, whatever removes the name
                os.rename(partial, final)
                _mark_checked(final, fd)
            except LocalWriteError as e:
                if fd is not None:
                    os.close(fd)
                _remove(final)
                with self._lock:  # the prefetch thread and the reader's may both meet the full disk
                    first, self._disk_full = not self._disk_full, True
                if first:
                    log.warning("shard cache %s: cannot hold %s: %s; reading the shards it does not hold from "
                                "the store instead (one GET per sample, slower)", self.spec.folder, url, e)
                return None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            with self._lock:
                self.fetches += 1
                self.bytes_fetched += length
            return fd

    def _count_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_fetched += n

    def _store_for(self, url: str) -> tuple[S3Store, str]:
        folder, _, key = url.rpartition("/")
        with self._lock:  # the prefetch thread and the reader's: one store (and request count) per folder
            if folder not in self._stores:
                self._stores[folder] = open_store(folder)
            return self._stores[folder], key

    def _make_room(self, need: int, incoming_next_use: float, partial: str) -> None:
        """Remove shards, those needed last first, until `need` more bytes fit, but none the node
        needs before the incoming one (that would only fetch it again); then reserve the space by
        creating `partial`, under the same lock, so that no other fetch counts it as free."""
        with locked(os.path.join(self.spec.folder, ".room" + LOCK)):
            shards, total = [], 0
            for entry in os.scandir(self.spec.folder):
                if entry.name.endswith(PARTIAL):
                    total += self._partial_size_or_discard(entry)
                elif not entry.name.endswith((LOCK, CHECKED)):
                    size = entry.stat().st_size
                    shards.append((self.next_use(entry.name), entry.name, size))
                    total += size
            for next_use, name, size in sorted(shards, reverse=True):
                if total + need <= self.spec.limit_bytes or next_use <= incoming_next_use:
                    break
                _remove(os.path.join(self.spec.folder, name))
                total -= size
            if total + need > self.spec.limit_bytes and not self._warned:
                self._warned = True
                log.warning("shard cache %s: the shards in use need %.1f GB, more than its %.1f GB limit "
                            "(data.cache_gb); going over it rather than fetching shards twice",
                            self.spec.folder, (total + need) / 1e9, self.spec.limit_bytes / 1e9)
            open(partial, "wb").close()

    def _partial_size_or_discard(self, entry: os.DirEntry) -> int:
        """A partial file whose lock nobody holds is a dead fetch's: removed. Else the bytes it will
        hold when whole (its name ends in them), not its size so far: that space is taken."""
        with locked(entry.path.removesuffix(PARTIAL) + LOCK, blocking=False) as free:
            if free:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                return 0
        return int(entry.name.removesuffix(PARTIAL).rsplit("-", 1)[1])


def _open_checked(path: str) -> int | None:
    """A descriptor of the cached file if it is still the file its fetch checked (its marker holds
    this inode, size, mtime and ctime); None when it is absent, changed, or was never checked."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        with open(path + CHECKED) as marker:
            if marker.read() == _identity(os.fstat(fd)):
                return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def _mark_checked(path: str, fd: int) -> None:
    """Written after the rename, which moves the ctime."""
    try:
        with open(path + CHECKED, "w") as marker:
            marker.write(_identity(os.fstat(fd)))
    except OSError as e:
        raise local_write_error(path + CHECKED, e) from None


def _identity(st: os.stat_result) -> str:
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def _remove(path: str) -> bool:
    """Remove a cached file and its marker; True if the file was there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + CHECKED)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
