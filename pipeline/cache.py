"""A node's shard cache: shards of an object-store dataset fetched whole, in large ranged GETs, onto
node-local disk, shared by every rank of the node and their loader workers, then read by offset.

One folder per node and dataset. A shard is fetched by one process while the others wait on its
lock (flock: the kernel releases it if that process dies), written under a partial name and renamed
when whole.

The bound (data.cache_gb) always holds: the bytes of the cached files plus the bytes reserved by
fetches in flight (a partial file reserves its whole length from the start) never exceed it, however
many ranks and loader workers fetch at once; every decision is taken under one folder-wide flock,
and a fetch renames its partial file to the final name under it too: a scan lists the folder, then
asks each partial file's lock whether its fetch lives, so a fetch that renamed and let go of its
lock in between would be counted as neither (a dead partial, and a name the listing lacks).
Room is made by removing cached shards, those this node reads no more this epoch first, then the one
it needs last (Belady: `next_use` knows the node's order). A shard a reader holds open (a shared
flock on the file) is never removed: its space is in use, and unlinking it would free nothing on
disk until that reader closes it. Eviction is lazy, so the folder fills to the bound and what an
epoch leaves behind is reused by the next run while it fits. When no room can be made:
- read-ahead (`prefetch`) fetches nothing and returns False: it may only remove shards needed after
  the one it fetches (anything else would only be fetched twice);
- a shard needed now (`open`) may remove any shard nobody holds open; if that is not enough it waits
  while fetches are in flight (they finish, and what they fetched may then be removed), and when none
  is, reads this shard from the store instead (coalesced ranged GETs ahead of need: stream.py),
  with one warning. It never
  waits for a reader to close a shard: ranks wait for each other in collectives, so that could
  deadlock. mosaicml-streaming (cache_limit) instead evicts the least-recently-used shard even if a
  worker is reading it (the worker downloads it again) and raises when nothing is left to evict.
`cache_footprint` states the same rule for the capacity planner.

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
folder and its free space, and that reader reads its uncached shards from the store instead
(stream.py: slower, but every sample arrives). What killed fetches left is removed
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
import time
from collections.abc import Callable
from dataclasses import dataclass

from vitforge.core import LocalWriteError, StorageError, Store, local_write_error, open_store

from .spec import LoaderSpec
from .stream import StreamedShard

log = logging.getLogger("vitforge.pipeline")
PARTIAL = ".partial"
LOCK = ".lock"
CHECKED = ".checked"  # the marker: the identity of the file whose size and sha256 were checked
NEVER = math.inf
ROOM_POLL_S = 0.05  # how often an open that waits for fetches in flight looks for room again


@dataclass
class CacheSpec:
    folder: str  # this node's folder for this dataset
    limit_bytes: int
    block_bytes: int  # bytes per ranged GET
    ahead: int  # shards fetched ahead of the one being read, per reader


def cache_spec(spec: LoaderSpec, node: int) -> CacheSpec:
    """This node's cache folder for the spec's dataset: ROOT/nodeN/DATASET-HASH. The node number
    keeps nodes apart even when their ranks run on one host (a test, or a shared temp folder)."""
    root = (
        spec.cache_dir or os.environ.get("VITFORGE_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "vitforge-cache")
    )
    dataset = hashlib.sha1(spec.dataset.encode()).hexdigest()[:12]
    return CacheSpec(
        os.path.join(root, f"node{node}", dataset),
        int(spec.cache_gb * 1e9),
        int(spec.read_block_mb * 2**20),
        spec.shards_ahead,
    )


@dataclass(frozen=True)
class CacheFootprint:
    """A node's shard cache under its bound, as `cache_footprint` works it out."""

    shards: int  # whole shards the bound holds
    ahead: int  # shards each reader really fetches ahead of those it holds open
    working_bytes: int  # what the readers hold open plus what they fetch ahead, node-wide
    peak_bytes: int  # the most the folder holds: eviction is lazy, so it fills to whole shards within the bound
    streams: bool  # the bound cannot hold the shards every reader has open: some are read from the store


def cache_footprint(
    shard_bytes: int, ranks_per_node: int, ahead: int, limit_bytes: int, *, open_shards: int = 1
) -> CacheFootprint:
    """The rule ShardCache follows, for shards of (at most) `shard_bytes`, `ranks_per_node` readers
    each holding `open_shards` open (1 + the shards a rank's shuffle window spans, when it spans
    several) and asking for `ahead` more, within `limit_bytes`. Open shards are never evicted, and a
    read-ahead never evicts a shard needed before its own, so each reader gets at least the same depth:
    the whole shards left per reader after the open ones, at most `ahead`. A rank's loader workers read
    the same shards, so they count as one reader."""
    if shard_bytes <= 0 or ranks_per_node < 1 or ahead < 0 or limit_bytes <= 0 or open_shards < 1:
        raise ValueError(
            f"cache_footprint needs shard_bytes > 0, ranks_per_node >= 1, ahead >= 0, limit_bytes > 0 "
            f"and open_shards >= 1, not {shard_bytes}, {ranks_per_node}, {ahead}, {limit_bytes}, "
            f"{open_shards}"
        )
    shards = limit_bytes // shard_bytes
    spare = shards // ranks_per_node - open_shards
    really = max(0, min(ahead, spare))
    working = min(shards, ranks_per_node * (open_shards + really))
    return CacheFootprint(shards, really, working * shard_bytes, shards * shard_bytes, spare < 0)


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


class ShardCache:
    """`next_use(file name)`: the node-order position at which the node next reads that shard
    (NEVER when not again this epoch); it decides what to remove when the folder is full."""

    def __init__(self, spec: CacheSpec, next_use: Callable[[str], float]):
        self.spec, self.next_use = spec, next_use
        os.makedirs(spec.folder, exist_ok=True)
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self.opens = self.fetches = self.bytes_fetched = 0
        self.skipped = 0  # read-aheads that found no room (nothing fetched)
        self.streamed = 0  # shards needed now that found no room, read from the store
        self._warned = False
        self._disk_full = False  # once a fetch could not be written, this reader streams what is not cached
        self._room_lock = os.path.join(spec.folder, ".room" + LOCK)  # every decision on the folder's bytes
        with locked(self._room_lock):
            for entry in os.scandir(spec.folder):
                if entry.name.endswith(PARTIAL):
                    self._partial_size_or_discard(entry)

    @property
    def requests(self) -> int:
        """The requests the shard stores sent (their optional `requests` count: see `Store`)."""
        with self._lock:
            return sum(getattr(store, "requests", 0) for store in self._stores.values())

    def open(self, url: str, length: int, sha256: str | None) -> ShardFile | StreamedShard:
        """The shard's first `length` bytes: its checked cached file (fetched if absent or changed),
        held open (so never evicted) until closed; or, when the node's disk or the bound cannot hold
        it, its byte ranges straight from the store."""
        with self._lock:
            self.opens += 1
        name = shard_file_name(url, length, sha256)
        fd = _open_checked(os.path.join(self.spec.folder, name), hold=True)
        if fd is None:
            fd = self._fetch(url, length, sha256, name, now=True)
        if fd is None:
            store, key = self._store_for(url)
            return StreamedShard(store, key, self._count_bytes)
        return ShardFile(fd)

    def prefetch(self, url: str, length: int, sha256: str | None) -> bool:
        """Fetch the shard ahead of need; False when there was no room for it (nothing fetched: the
        caller may ask again later) or the disk is full."""
        name = shard_file_name(url, length, sha256)
        fd = _open_checked(os.path.join(self.spec.folder, name))
        if fd is None:
            fd = self._fetch(url, length, sha256, name, now=False)
        if fd is None:
            return False
        os.close(fd)
        return True

    def _fetch(self, url: str, length: int, sha256: str | None, name: str, now: bool) -> int | None:
        """Under the shard's lock: a descriptor of the checked file (held open when needed `now`),
        fetched unless another process made it while we waited; a changed copy is evicted first.
        None when the disk or the bound cannot hold it."""
        final = os.path.join(self.spec.folder, name)
        with locked(final + LOCK):
            fd = _open_checked(final, hold=now)
            if fd is not None:
                return fd
            evicted = _remove(final)
            if evicted:
                log.warning(
                    "shard cache: %s is not what its fetch checked (changed since, or never checked); "
                    "removed, fetching %s again",
                    final,
                    url,
                )
            if self._disk_full:
                return None
            partial = final + PARTIAL
            fd = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)  # a dead fetch's (we hold its lock): it must not count as in flight
            if not self._make_room(length, self.next_use(name), partial, now):
                self._no_room(url, length, now)
                return None
            try:
                self._download_checked(url, length, sha256, partial, final, evicted)
                fd = os.open(partial, os.O_RDONLY)  # the inode, whatever removes the name
                if now:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # held before it has a name that eviction sees
                # Under the folder's lock, or a scan that listed the partial name could find its lock
                # free by the time it asks, count this shard as room and admit one fetch too many.
                with locked(self._room_lock):
                    os.rename(partial, final)
                _mark_checked(final, fd)
            except LocalWriteError as e:
                if fd is not None:
                    os.close(fd)
                _remove(final)
                with self._lock:  # the prefetch thread and the reader's may both meet the full disk
                    first, self._disk_full = not self._disk_full, True
                if first:
                    log.warning(
                        "shard cache %s: cannot hold %s: %s; reading the shards it does not hold from "
                        "the store instead (ranged GETs of a few samples each, slower)",
                        self.spec.folder,
                        url,
                        e,
                    )
                return None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            with self._lock:
                self.fetches += 1
                self.bytes_fetched += length
            return fd

    def _download_checked(
        self, url: str, length: int, sha256: str | None, partial: str, final: str, evicted: bool
    ) -> None:
        """The shard's first `length` bytes into `partial`, in parallel ranged GETs, checked against
        its sha256 when dataset.json gives one (`evicted`: a cached copy failed that check)."""
        store, key = self._store_for(url)
        digest = store.download(
            key,
            partial,
            part_bytes=self.spec.block_bytes,
            threads=max(1, min(8, -(-length // self.spec.block_bytes))),
            length=length,
        )
        if sha256 is not None and digest != sha256:
            again = " (fetched again after the cached copy failed its check)" if evicted else ""
            raise StorageError(
                f"{url}: the object differs from dataset.json (its first {length} bytes hash "
                f"to {digest}, not {sha256}); not cached as {final}{again}"
            )

    def _count_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_fetched += n

    def _store_for(self, url: str) -> tuple[Store, str]:
        folder, _, key = url.rpartition("/")
        with self._lock:  # the prefetch thread and the reader's: one store (and request count) per folder
            if folder not in self._stores:
                self._stores[folder] = open_store(folder)
            return self._stores[folder], key

    def _make_room(self, need: int, incoming_next_use: float, partial: str, now: bool) -> bool:
        """Make room for `need` more bytes within the bound and reserve it by creating `partial`, all
        under the folder's lock, so that no other fetch counts it as free; False when there is none.
        Removed first: shards this node reads no more this epoch, then those it needs last; never one
        a reader holds open, and, unless the shard is needed `now`, none needed before it. A shard
        needed now waits while fetches are in flight: once whole, theirs may be removed."""
        if need > self.spec.limit_bytes:
            return False
        while True:
            with locked(self._room_lock):
                shards, total, in_flight = [], 0, False
                for entry in os.scandir(self.spec.folder):
                    if entry.name.endswith(PARTIAL):
                        reserved = self._partial_size_or_discard(entry)
                        total, in_flight = total + reserved, in_flight or reserved > 0
                    elif not entry.name.endswith((LOCK, CHECKED)):
                        with contextlib.suppress(FileNotFoundError):  # a changed copy, removed by its fetch
                            size = entry.stat().st_size
                            shards.append((self.next_use(entry.name), entry.name, size))
                            total += size
                taken = []  # (path, descriptor holding its exclusive lock): removed if that makes room
                for next_use, name, size in sorted(shards, reverse=True):
                    if total + need <= self.spec.limit_bytes or (not now and next_use <= incoming_next_use):
                        break
                    path = os.path.join(self.spec.folder, name)
                    fd = _lock_unheld(path)
                    if fd is not None:
                        taken.append((path, fd))
                        total -= size
                fits = total + need <= self.spec.limit_bytes
                for path, fd in taken:
                    if fits:
                        _remove(path)
                    os.close(fd)
                if fits:
                    open(partial, "wb").close()
                    return True
            if not (now and in_flight):
                return False
            time.sleep(ROOM_POLL_S)

    def _no_room(self, url: str, length: int, now: bool) -> None:
        with self._lock:
            if not now:
                self.skipped += 1
                return
            self.streamed += 1
            first, self._warned = not self._warned, True
        if first:
            log.warning(
                "shard cache %s: no room for %s (%.2f GB) within its %.2f GB limit (data.cache_gb): the "
                "shards readers hold open fill it; reading it from the store instead (ranged GETs of a "
                "few samples each, slower). Raise data.cache_gb or lower data.shards_ahead.",
                self.spec.folder,
                url,
                length / 1e9,
                self.spec.limit_bytes / 1e9,
            )

    def _partial_size_or_discard(self, entry: os.DirEntry) -> int:
        """A partial file whose lock nobody holds is a dead fetch's: removed. Else the bytes it will
        hold when whole (its name ends in them), not its size so far: that space is taken."""
        with locked(entry.path.removesuffix(PARTIAL) + LOCK, blocking=False) as free:
            if free:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                return 0
        return int(entry.name.removesuffix(PARTIAL).rsplit("-", 1)[1])


def _open_checked(path: str, hold: bool = False) -> int | None:
    """A descriptor of the cached file if it is still the file its fetch checked (its marker holds
    this inode, size, mtime and ctime); None when it is absent, changed, or was never checked.
    `hold`: with a shared flock on it, which keeps it from eviction until the descriptor is closed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if hold:
            # An evictor holds the exclusive lock only while it removes the file and its marker: once
            # ours is granted, the marker check below tells whether this inode is still the cached one.
            fcntl.flock(fd, fcntl.LOCK_SH)
        with open(path + CHECKED) as marker:
            if marker.read() == _identity(os.fstat(fd)):
                return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def _lock_unheld(path: str) -> int | None:
    """A descriptor holding the file's exclusive flock, or None when a reader holds it open (or it
    is gone): only then may it be removed, and nobody can open it for reading until we close."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
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
