"""Parquet in the Hugging Face `datasets` layout: the images inside the file.

An `Image` feature is a column `struct<bytes: binary, path: string>`; labels an integer column
whose class names live in the schema metadata key `huggingface`
(`{"info": {"features": {"label": {"_type": "ClassLabel", "names": [...]}}}}`). A row with bytes
is packed from them; a row with null bytes and a path resolves the path like a manifest row.

Order: the plan shuffles globally, which for images inside one file would make every shard read
rows from every row group. So rows are grouped into windows of whole row groups (WINDOW_ROWS rows
or WINDOW_BYTES of data, whichever comes first); the plan shuffles the windows as wholes and the
rows within each window (`SourceRecord.group`), and `EmbeddedImages` reads a row group once per
window that needs it.

Per process: listing holds one record batch and the distinct labels; packing (and --dedup's
planning pass) holds the image bytes of at most 2 x WINDOW_BYTES of row groups, or of one row
group if that is larger: a window is within WINDOW_BYTES or one row group.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from .manifests import FileRows, discard_copy, jsonable, label_id, local_copy
from .records import Corpus, SourceError, SourceRecord, display_path

WINDOW_ROWS = 2048
WINDOW_BYTES = 128 << 20
ROW_PREFIX = "row:"  # an embedded image's source: "row:N" (no resolved path or URL starts so)


def embedded_row(source: str) -> int | None:
    """The row number of an embedded image's source, None for a path."""
    return int(source[len(ROW_PREFIX) :]) if source.startswith(ROW_PREFIX) else None


def shown_source(source: str, src: str) -> str:
    """How outputs and messages name an input: an embedded row as SRC#row=N."""
    row = embedded_row(source)
    return display_path(source if row is None else f"{src}#row={row}")


def from_hf_parquet(
    path: str,
    classes: list[str] | None,
    image_column: str,
    label_column: str | None,
    root: str | None,
    meta_columns: tuple[str, ...] | None = None,
) -> Corpus:
    """The corpus of a `datasets` Parquet file. Class names: `classes`, else the file's ClassLabel
    names, else ids 0..max as names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        local = local_copy(path)
    except FileNotFoundError:
        raise SourceError(f"{path}: Parquet file not found") from None
    try:
        with pq.ParquetFile(local) as table:
            schema = table.schema_arrow
            _check_image_column(path, schema, image_column)
            if label_column and label_column not in schema.names:
                raise SourceError(f"{path}: no column {label_column!r} (columns: {', '.join(schema.names)})")
            missing = [c for c in meta_columns or () if c not in schema.names]
            if missing:
                raise SourceError(f"{path}: no column {missing[0]!r} (columns: {', '.join(schema.names)})")
            numeric = bool(label_column) and pa.types.is_integer(schema.field(label_column).type)
            if label_column and not numeric and not pa.types.is_string(schema.field(label_column).type):
                raise SourceError(
                    f"{path}: column {label_column!r} has type {schema.field(label_column).type}; "
                    "expected integer (class id) or string (class name)"
                )
            if label_column and classes is None:
                classes = class_label_names(schema, label_column)
                if classes is None:
                    labels = {
                        v
                        for b in table.iter_batches(columns=[label_column], use_threads=False)
                        for v in b.column(0).to_pylist()
                        if v not in (None, "")
                    }
                    classes = [str(i) for i in range(max(labels, default=-1) + 1)] if numeric else sorted(labels)
            windows = _windows(table.metadata)
    except BaseException:
        discard_copy(path, local)
        raise
    records = _records(
        path, local, image_column, label_column, list(classes or []), numeric, root, meta_columns, windows
    )
    return Corpus(records, list(classes or []) if label_column else [])


def class_label_names(schema, label_column: str) -> list[str] | None:
    """The ClassLabel names `datasets` stored for `label_column`, or None."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label_column]
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    return [str(n) for n in names] if isinstance(names, list) else None


def _check_image_column(path: str, schema, column: str) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise SourceError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    fields = (
        {kind.field(i).name: kind.field(i).type for i in range(kind.num_fields)} if pa.types.is_struct(kind) else {}
    )
    data = fields.get("bytes", pa.null())
    if not (pa.types.is_binary(data) or pa.types.is_large_binary(data)):
        raise SourceError(
            f"{path}: column {column!r} has type {kind}; expected the datasets Image layout "
            "struct<bytes: binary, path: string>"
        )


def _windows(metadata) -> list[int]:
    """The window of each row group: consecutive whole row groups, closed once they hold
    WINDOW_ROWS rows, and before a group that would take them past WINDOW_BYTES (uncompressed, as
    the file's metadata says): a window is within WINDOW_BYTES or a single row group."""
    windows, window, rows, size = [], 0, 0, 0
    for group in range(metadata.num_row_groups):
        group_bytes = metadata.row_group(group).total_byte_size
        if rows and size + group_bytes > WINDOW_BYTES:
            window, rows, size = window + 1, 0, 0
        windows.append(window)
        rows += metadata.row_group(group).num_rows
        size += group_bytes
        if rows >= WINDOW_ROWS:
            window, rows, size = window + 1, 0, 0
    return windows


def _records(
    path: str,
    local: str,
    image_column: str,
    label_column: str | None,
    classes: list[str],
    numeric: bool,
    root: str | None,
    meta_columns: tuple[str, ...] | None,
    windows: list[int],
) -> Iterator[SourceRecord]:
    import pyarrow.parquet as pq

    files = FileRows.of(path, root)
    ids = {name: i for i, name in enumerate(classes)}
    name = os.path.basename(path)
    others = list(meta_columns) if meta_columns is not None else None
    try:
        with pq.ParquetFile(local) as table:
            if others is None:
                others = [c for c in table.schema_arrow.names if c not in (image_column, label_column)]
            n = 0
            for group in range(table.metadata.num_row_groups):
                for size, image_path, raw_label, meta in _row_group(table, group, image_column, label_column, others):
                    label = label_id(raw_label, ids, numeric, len(classes)) if label_column else None
                    meta = {k: jsonable(v) for k, v in meta.items()}
                    if size is not None:
                        record = SourceRecord(
                            f"{ROW_PREFIX}{n}",
                            label,
                            size,
                            meta,
                            name=f"{name}#row={n}",
                            group=f"{name}#window={windows[group]}",
                        )
                    else:
                        record = files.record(
                            image_path,
                            label,
                            meta,
                            f"row {n}",
                            f"row {n}: neither bytes nor a path in {image_column!r}",
                        )
                    if record.problem is None and label is None and label_column:
                        record.problem = ("label_unknown", f"row {n}: label {raw_label!r} is not in the class map")
                    yield record
                    n += 1
    finally:
        discard_copy(path, local)


def _row_group(
    table, group: int, image_column: str, label_column: str | None, others: list[str]
) -> Iterator[tuple[int | None, str | None, object, dict]]:
    """One row group's rows as (image bytes' size, image path, label as stored, the kept columns);
    an image without bytes (or path) gives None there."""
    import pyarrow.compute as pc

    # The image bytes are read only to learn their sizes (the plan's shard sizes).
    batch = table.read_row_group(
        group, columns=[image_column, *([label_column] if label_column else []), *others], use_threads=False
    )
    images = batch.column(image_column).combine_chunks()
    sizes = pc.binary_length(images.field("bytes")).to_pylist()
    paths = images.field("path").to_pylist() if images.type.get_field_index("path") >= 0 else [None] * len(images)
    labels = batch.column(label_column).to_pylist() if label_column else [None] * len(images)
    metas = batch.select(others).to_pylist()
    return zip(sizes, paths, labels, metas)


class EmbeddedImages:
    """Reads embedded images by row number, a row group at a time, from a local copy of the file
    (a remote one is downloaded once per task). Caches row groups (image bytes only) up to
    2 x WINDOW_BYTES, or one row group if that is larger. Not thread-safe."""

    def __init__(self, path: str, image_column: str):
        import pyarrow.parquet as pq

        self.path, self.column = path, image_column
        self._local = local_copy(path)
        self._file = pq.ParquetFile(self._local)
        self._starts = []
        start = 0
        for group in range(self._file.metadata.num_row_groups):
            self._starts.append(start)
            start += self._file.metadata.row_group(group).num_rows
        self._cache: OrderedDict[int, Any] = OrderedDict()  # pyarrow arrays
        self.row_groups_read = 0

    def read(self, row: int) -> bytes:
        group = bisect.bisect_right(self._starts, row) - 1
        images = self._cache.get(group)
        if images is None:
            images = (
                self._file.read_row_group(group, columns=[self.column], use_threads=False)
                .column(0)
                .combine_chunks()
                .field("bytes")
            )
            self.row_groups_read += 1
            self._cache[group] = images
            while len(self._cache) > 1 and sum(v.nbytes for v in self._cache.values()) > 2 * WINDOW_BYTES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(group)
        return images[row - self._starts[group]].as_py()

    def close(self) -> None:
        self._file.close()
        discard_copy(self.path, self._local)


@contextlib.contextmanager
def row_reader(path: str, image_column: str, read_file: Callable[[str], bytes]):
    """`read(source)` for --dedup's planning pass, from any thread: an embedded row's image bytes,
    or the file a path row names (through `read_file`). Rows come in listing order, so each row
    group is read once (a remote file is downloaded for this pass, and again for packing)."""
    images = EmbeddedImages(path, image_column)
    lock = threading.Lock()

    def read(source: str) -> bytes:
        row = embedded_row(source)
        if row is None:
            return read_file(source)
        with lock:
            return images.read(row)

    try:
        yield read
    finally:
        images.close()
