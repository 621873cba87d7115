"""A node's shard cache: shards of an object-store dataset fetched whole, in large ranged GETs, onto
node-local disk, shared by every rank of the node and their loader workers, then read by offset.

One folder per node and dataset. A shard is fetched by one process while the others wait on its
lock (flock: the kernel releases it if that process dies), written under a partial name and renamed
when whole, so a file with a shard's name is always complete. The folder is bounded: to make room,
the shards the node's order needs last (first those it needs no more this epoch) are removed; a
reader that still has one open keeps reading it (an unlinked file lives while open).
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

from vitforge.core import S3Store, open_store

from .spec import LoaderSpec

log = logging.getLogger("vitforge.pipeline")
PARTIAL = ".partial"
LOCK = ".lock"
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

    @property
    def requests(self) -> int:
        with self._lock:
            return sum(store.requests for store in self._stores.values())

    def open(self, url: str, length: int, sha256: str | None) -> int:
        """A read-only descriptor of the shard's first `length` bytes, fetched if absent."""
        with self._lock:
            self.opens += 1
        name = shard_file_name(url, length, sha256)
        try:
            return os.open(os.path.join(self.spec.folder, name), os.O_RDONLY)
        except FileNotFoundError:
            return self._fetch(url, length, name, keep_open=True)

    def prefetch(self, url: str, length: int, sha256: str | None) -> None:
        name = shard_file_name(url, length, sha256)
        if not os.path.exists(os.path.join(self.spec.folder, name)):
            self._fetch(url, length, name, keep_open=False)

    def _fetch(self, url: str, length: int, name: str, keep_open: bool) -> int:
        final = os.path.join(self.spec.folder, name)
        with locked(final + LOCK):
            with contextlib.suppress(FileNotFoundError):  # another process fetched it while we waited
                return os.open(final, os.O_RDONLY) if keep_open else -1
            partial = final + PARTIAL
            self._make_room(length, self.next_use(name), partial)
            store, key = self._store_for(url)
            store.download(key, partial, part_bytes=self.spec.block_bytes,
                           threads=max(1, min(8, -(-length // self.spec.block_bytes))), length=length)
            fd = os.open(partial, os.O_RDONLY) if keep_open else -1  # the inode, whatever removes the name
            os.rename(partial, final)
            with self._lock:
                self.fetches += 1
                self.bytes_fetched += length
            return fd

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
                elif not entry.name.endswith(LOCK):
                    size = entry.stat().st_size
                    shards.append((self.next_use(entry.name), entry.name, size))
                    total += size
            for next_use, name, size in sorted(shards, reverse=True):
                if total + need <= self.spec.limit_bytes or next_use <= incoming_next_use:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.spec.folder, name))
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
