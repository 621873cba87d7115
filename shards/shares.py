"""One share of a corpus, for a job array that plans together (shards/array_plan.py): share s of n
is rows [s*N/n, (s+1)*N/n) of a Parquet list, or a contiguous run of a folder's top-level entries
(class folders), so the shares in order are the listing's order.

A share is read alone: a list's row groups that hold its rows (a remote list by ranged reads,
and its footer), a folder's top-level names (those of its share stat'ed) and its entries'
subtrees (a local folder's link check still walks every folder, not their files). Per share: one
record batch, or one folder's entries, at a time.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator

from vitforge.core import is_remote as is_url
from vitforge.core import object_store

from .folders import from_class_folders, from_folder, local_files, remote_files
from .manifests import ParquetShare, class_map, parquet_share_labels, parquet_share_records
from .records import SourceError, SourceRecord
from .sources import MANIFEST_SUFFIXES, with_sizes


def shareable(src: str, image_column: str | None) -> bool:
    """Whether `src` can be listed in shares: a Parquet list (paths or URLs), or a folder."""
    lower = src.rstrip("/").lower()
    return not image_column and (lower.endswith(".parquet") or not lower.endswith(MANIFEST_SUFFIXES))


def check_source(src: str, columns: list[str]) -> None:
    """A Parquet list's `columns` exist and it has rows; a folder exists (each task checks it)."""
    src = _local(src)
    if not src.lower().endswith(".parquet"):
        if not is_url(src) and not os.path.isdir(src):
            raise SourceError(f"{src}: not a folder, and not a .csv/.jsonl/.parquet manifest")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _Opened(src) as source:
        try:
            with pq.ParquetFile(source) as table:
                names, rows = table.schema_arrow.names, table.metadata.num_rows
        except pa.ArrowInvalid as e:
            raise SourceError(f"{src}: not a Parquet file ({e})") from None
    for column in columns:
        if column not in names:
            raise SourceError(f"{src}: no column {column!r} (columns: {', '.join(map(str, names))})")
    if not rows:
        raise SourceError(f"{src}: manifest has no rows")


def share_labels(src: str, share: tuple[int, int], label_column: str, follow_symlinks: bool, root: str | None) -> list:
    """The distinct labels of a share: a list's label values, or the class folders holding an input."""
    src = _local(src)
    if src.lower().endswith(".parquet"):
        with _Opened(src) as source:
            return sorted(parquet_share_labels(src, source, label_column, _parquet_share(source, share)), key=repr)
    names: list[str] = []
    for _ in from_class_folders(src, _files(src, share, True, follow_symlinks, root), None, names, required=False):
        pass
    return names


def share_classes(src: str, labels: set, classes: list[str] | None) -> tuple[list[str], bool]:
    """The class map from every share's labels: as a whole listing gives it."""
    if _local(src).lower().endswith(".parquet"):
        return class_map(labels, classes, True)
    return (list(classes) if classes is not None else sorted(labels)), False


def share_records(
    src: str,
    share: tuple[int, int],
    *,
    classes: list[str],
    numeric: bool,
    path_column: str,
    label_column: str | None,
    root: str | None,
    url_list: bool,
    meta_columns: tuple[str, ...] | None,
    follow_symlinks: bool,
) -> Iterator[SourceRecord]:
    """A share's records, as the whole listing has them (a list's rows numbered in the file)."""
    src = _local(src)
    if src.lower().endswith(".parquet"):
        with _Opened(src) as source:
            records = parquet_share_records(
                src,
                source,
                classes,
                numeric,
                path_column,
                label_column,
                root,
                url_list,
                meta_columns,
                _parquet_share(source, share),
            )
            yield from records if url_list else with_sizes(records)
        return
    files = _files(src, share, label_column is not None, follow_symlinks, root)
    if label_column is None:
        yield from from_folder(src, files, required=False)
    else:
        yield from from_class_folders(src, files, classes, list(classes), required=False)


def _files(src: str, share: tuple[int, int], by_class: bool, follow_symlinks: bool, root: str | None):
    if is_url(src):
        return remote_files(src, by_class, share)
    return local_files(src, follow_symlinks, root or src, by_class, share)


def _parquet_share(source, share: tuple[int, int]) -> ParquetShare:
    """Share s of n of the file's rows, and the row groups that hold them (a few large row groups
    are split between tasks: each reads the groups its rows are in, and keeps only its rows)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(source) as table:
        counts = [table.metadata.row_group(g).num_rows for g in range(table.metadata.num_row_groups)]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    s, n = share
    rows = range(s * starts[-1] // n, (s + 1) * starts[-1] // n)
    if not rows:
        return ParquetShare(rows, range(0), 0)
    first = max(g for g in range(len(counts)) if starts[g] <= rows.start)
    last = min(g for g in range(len(counts)) if starts[g + 1] >= rows.stop)
    return ParquetShare(rows, range(first, last + 1), starts[first])


def _local(src: str) -> str:
    return src[len("file://") :] if src.startswith("file://") else src


class _RangeFile(io.RawIOBase):
    """An object in a store as a seekable read-only file: reads are ranged GETs, so a task reading
    its row groups of a remote list fetches its share (and the footer), not the whole file."""

    def __init__(self, url: str):
        self._store, self._name = object_store(url)
        self._size = self._store.stat(self._name).size
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence] + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer) -> int:
        end = min(self._size, self._at + len(buffer))
        if end <= self._at:
            return 0
        data = self._store.get_range(self._name, self._at, end)
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)


class _Opened:
    """The list to read: a local path as it is, a store's object as a ranged-read file."""

    def __init__(self, src: str):
        self._src = src
        self._file: io.BufferedReader | None = None

    def __enter__(self):
        if not is_url(self._src):
            if not os.path.exists(self._src):
                raise SourceError(f"{self._src}: manifest not found")
            return self._src
        try:
            self._file = io.BufferedReader(_RangeFile(self._src), buffer_size=1 << 20)
        except FileNotFoundError:
            raise SourceError(f"{self._src}: manifest not found") from None
        return self._file

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()
