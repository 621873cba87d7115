"""A local (or shared-filesystem) folder as a Store: writes land under a temporary name in the same
filesystem and are renamed into place; compare-and-swap holds an exclusive lock on a lock file."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import os
import shutil
from dataclasses import dataclass

from .errors import PreconditionFailed, StorageError, UsageError
from .files import PARTIAL_MARK, atomic_write, create_file, make_folder, replace_into
from .store import ObjectInfo, discard_stale, temp_name


def open_local(url: str, work_dir: str) -> LocalStore:
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
        return temp_name(self._temp_dir(), name)

    def put_file(self, local_path: str, name: str, keep: bool = False) -> None:
        """Move (or with `keep`, copy) a local file into the store, all or nothing."""
        target = self.url(name)
        try:  # the target's folder is made as it is renamed into place (replace_into)
            if keep or not _same_device(local_path, self.root):  # the root: no tidy removes it
                tmp = self.temp_path(name)
                try:
                    create_file(tmp).close()  # in the work folder from now: no tidy removes the folder
                    shutil.copyfile(local_path, tmp)
                    _fsync(tmp)
                    replace_into(tmp, target)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                if not keep:
                    os.unlink(local_path)
            else:
                replace_into(local_path, target)
        except OSError as e:
            raise _local_error(target, e) from None

    def put_bytes(self, name: str, data: bytes) -> None:
        try:
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
        try:
            with create_file(f"{path}.lock", "ab") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                current = self.get_versioned(name)
                if (current[1] if current else None) != version:
                    raise PreconditionFailed(f"{path}: changed by another writer")
                atomic_write(path, data)
        except StorageError:
            raise  # PreconditionFailed: the compare lost, the caller's to handle
        except OSError as e:
            raise _local_error(path, e) from None
        return hashlib.sha256(data).hexdigest()

    def download(
        self, name: str, local_path: str, part_bytes: int = 16 << 20, threads: int = 8, length: int | None = None
    ) -> str:
        """Copy to a local file; return the sha256 of what was written (hashed as it is copied).
        A local copy is bound by the disk, not by latency: one sequential pass, no threads."""
        digest = hashlib.sha256()
        left = -1 if length is None else length
        try:
            with open(self.url(name), "rb") as source, open(local_path, "wb") as target:
                while left and (chunk := source.read(8 << 20 if left < 0 else min(left, 8 << 20))):
                    digest.update(chunk)
                    target.write(chunk)
                    left -= len(chunk) if left > 0 else 0
            return digest.hexdigest()
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url(name)}: no such file") from None
        except OSError as e:
            raise _local_error(self.url(name), e) from None

    def get_range(self, name: str, start: int, end: int, version: str | None = None) -> bytes:
        """A local file is replaced whole by rename, so an open handle reads one version; `version`
        is stat's, checked on the open handle."""
        try:
            with open(self.url(name), "rb") as f:
                if version is not None and _version(os.fstat(f.fileno())) != version:
                    raise PreconditionFailed(f"{self.url(name)}: changed by another writer")
                f.seek(start)
                return f.read(end - start)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url(name)}: no such file") from None
        except PreconditionFailed:
            raise  # an OSError too, but already the answer
        except OSError as e:
            raise _local_error(self.url(name), e) from None

    def stat(self, name: str) -> ObjectInfo:
        """The version a pinned read compares: inode, size and modification time (not a hash: stat
        must be cheap on a 2 GB checkpoint file). put_if compares get_versioned's sha256 of small objects."""
        try:
            st = os.stat(self.url(name))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url(name)}: no such file") from None
        except OSError as e:
            raise _local_error(self.url(name), e) from None
        return ObjectInfo(st.st_size, _version(st))

    def exists(self, name: str) -> bool:
        return os.path.exists(self.url(name))

    def list(self, prefix: str) -> list[str]:
        return sorted(f"{prefix.rstrip('/')}/{n}" if prefix else n for n in self.list_folder(prefix)[1])

    # (builtins.list: in the class body below `def list`, a bare `list` names that method)
    def list_folder(self, prefix: str) -> tuple[builtins.list[str], dict[str, int]]:
        folder = self.url(prefix)
        folders, files = [], {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir():
                    folders.append(entry.name)
                elif PARTIAL_MARK not in entry.name and not entry.name.endswith(".lock"):
                    with contextlib.suppress(FileNotFoundError):
                        files[entry.name] = entry.stat().st_size
        return sorted(folders), files

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

    def delete(self, names: builtins.list[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.url(name))
        # Folders emptied go, as an object store has none; the root and what holds it stay.
        inside = self.root.rstrip(os.sep) + os.sep
        for folder in sorted({os.path.normpath(os.path.dirname(self.url(n))) for n in names}, key=len, reverse=True):
            while folder.startswith(inside):
                try:
                    os.rmdir(folder)
                except OSError:
                    break
                folder = os.path.dirname(folder)

    def abort_uploads(self, prefix: str) -> int:
        """Remove the temporaries of dead writers on this host (a local store keeps every
        temporary in its one work folder, whatever the prefix)."""
        folder = self._temp_dir()
        return discard_stale(folder, set()) if os.path.isdir(folder) else 0

    def local_copy(self, name: str, folder: str) -> str:
        return self.url(name)

    def local_path(self, name: str) -> str | None:
        """Where the object already lies on this machine, so callers can skip a download."""
        return self.url(name)

    def discard_stale_temporaries(self, shard_names: set[str]) -> None:
        discard_stale(self._temp_dir(), shard_names)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self._temp_dir())  # fails while another part has a file there; one about to write makes it again

    def _temp_dir(self) -> str:
        folder = os.path.join(self.root, self.work_dir)
        try:
            make_folder(folder)
        except OSError as e:
            raise _local_error(folder, e) from None
        return folder


def _version(st: os.stat_result) -> str:
    """A replacement is a new file renamed into place: a new inode, even when its size and (coarse,
    a few ms) modification time equal the old one's."""
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"


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
