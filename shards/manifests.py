"""Reading a CSV / TSV / JSONL / JSON / Parquet manifest of image paths (local or in a store) into
SourceRecords: row by row (Parquet by record batch), twice (once for its class map and types,
once for its records); every row must resolve inside the manifest's root.

Per listing: the distinct labels and one record batch; a remote manifest is read from a local copy."""

from __future__ import annotations

import csv
import functools
import json
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vitforge.core import is_remote as is_url
from vitforge.core import object_store, without_userinfo

from .records import Corpus, SourceError, SourceRecord, display_path

# What a manifest's path and label cells may hold (nulls aside: those rows are rejects).
EXPECTED_TYPES = {"path": "string", "label": "string (class name) or integer (class id)"}


def _manifest_rows(
    path: str, local, typed: dict[str, str], columns: list[str] | None = None, share: ParquetShare | None = None
) -> Iterator[dict]:
    """The rows of the manifest `path` (read from `local`: a path, or a file object), once the
    columns in `typed` (column -> "path" or "label") hold the types they must: checked in the
    Parquet schema, or in every JSON row (CSV cells are all strings). Streamed: a line, or a
    Parquet record batch, at a time. `columns`, `share`: read only these (Parquet only)."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        with pq.ParquetFile(local) as table:
            schema = table.schema_arrow
            for column, role in typed.items():
                if column in schema.names and not _arrow_type_fits(schema.field(column).type, role):
                    raise SourceError(
                        f"{path}: column {column!r} has type {schema.field(column).type}; "
                        f"expected {EXPECTED_TYPES[role]}"
                    )
            # one thread: pyarrow's pool could abort the process at exit ("terminate called without an
            # active exception")
            groups = list(share.row_groups) if share is not None else None
            at = share.first_row if share is not None else 0  # the file's row number of the batch's first
            for batch in table.iter_batches(batch_size=8192, row_groups=groups, columns=columns, use_threads=False):
                if share is not None:  # only the share's rows of the row groups that hold them
                    start, stop = max(share.rows.start - at, 0), min(share.rows.stop - at, batch.num_rows)
                    at += batch.num_rows
                    if start >= stop:
                        continue
                    batch = batch.slice(start, stop - start)
                yield from batch.to_pylist()
        return
    if lower.endswith((".jsonl", ".json")):
        with open(local, encoding="utf-8") as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    yield _json_row(path, n, line, typed)
        return
    with open(local, encoding="utf-8", newline="") as text:
        yield from csv.DictReader(text, delimiter="\t" if lower.endswith(".tsv") else ",")


def _json_row(path: str, n: int, line: str, typed: dict[str, str]) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise SourceError(f"{path}:{n}: not a JSON object but {cell(row)}")
    for column, role in typed.items():
        if not _value_fits(row.get(column), role):
            raise SourceError(f"{path}:{n}: column {column!r} is {cell(row[column])}; expected {EXPECTED_TYPES[role]}")
    return row


def _manifest_summary(
    path: str, local: str, typed: dict[str, str], label_column: str | None
) -> tuple[list | None, set]:
    """The first pass: the first row's columns (None: no rows) and the distinct labels, after every
    row passed the checks of `_manifest_rows` (so a bad row stops the run before any record)."""
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        with pq.ParquetFile(local) as table:
            names = table.schema_arrow.names if table.metadata.num_rows else None
        labels: set[str] = set()
        if names is not None and label_column in names:  # the label column alone: cheap
            labels.update(row[label_column] for row in _manifest_rows(path, local, typed, [label_column]))
        return names, labels
    first, labels = None, set()
    for row in _manifest_rows(path, local, typed):
        first = first if first is not None else list(row)
        if label_column:
            labels.add(row.get(label_column))
    return first, labels


def local_copy(path: str) -> str:
    """A local manifest's own path; a remote one is downloaded (by its store, which retries) to a
    temporary file that the caller deletes, so both passes stream from disk."""
    if not is_url(path):
        return path
    handle, local = tempfile.mkstemp(prefix="vitforge-manifest-", suffix=os.path.splitext(path)[1])
    os.close(handle)
    try:
        store, name = object_store(path)
        store.download(name, local)
    except BaseException:
        os.unlink(local)
        raise
    return local


def _arrow_type_fits(arrow_type, role: str) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):  # pandas categoricals
        arrow_type = arrow_type.value_type
    is_string = pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
    return is_string or (role == "label" and pa.types.is_integer(arrow_type))


def _value_fits(value, role: str) -> bool:
    if value is None or isinstance(value, str):
        return True
    return role == "label" and isinstance(value, int) and not isinstance(value, bool)


def cell(value) -> str:
    """A JSON value's type and a short form of it, for an error message."""
    kinds = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    shown = repr(value)
    return f"{kinds.get(type(value), type(value).__name__)} ({shown[:40] + '...' if len(shown) > 40 else shown})"


def from_manifest(
    path: str,
    classes: list[str] | None,
    path_column: str,
    label_column: str | None,
    root: str | None,
    url_list: bool = False,
    meta_columns: tuple[str, ...] | None = None,
) -> Corpus:
    """`label_column` None: an unlabelled corpus. Every column but the path and the label is kept as
    metadata, or only `meta_columns` when given. `url_list`: the path column holds http(s) URLs to
    download (a URL list: no root applies, a row with any other value is a `bad_url` reject).
    Two passes over the manifest: the first checks every row and collects the distinct labels (the
    class map must be known before the first record: ids come from all labels, sorted), the
    second makes the records. Per input nothing is kept but the distinct labels."""
    typed = {path_column: "path", **({label_column: "label"} if label_column else {})}
    try:
        local = local_copy(path)
    except FileNotFoundError:
        raise SourceError(f"{path}: manifest not found") from None
    try:
        try:
            columns, labels = _manifest_summary(path, local, typed, label_column)
        except FileNotFoundError:
            raise SourceError(f"{path}: manifest not found") from None
        if columns is None:
            raise SourceError(f"{path}: manifest has no rows")
        for column in (path_column, *([label_column] if label_column else []), *(meta_columns or ())):
            if column not in columns:
                raise SourceError(f"{path}: no column {column!r} (columns: {', '.join(map(str, columns))})")
    except BaseException:
        discard_copy(path, local)
        raise
    classes, numeric = class_map(labels, classes, bool(label_column))
    records = _manifest_records(
        path, local, typed, classes, numeric, path_column, label_column, root, url_list, meta_columns
    )
    return Corpus(records, list(classes))


def class_map(labels: set, classes: list[str] | None, labelled: bool) -> tuple[list[str], bool]:
    """The class names and whether labels are ids, from a listing's distinct labels: integers are
    ids (classes "0".."max"), anything else names sorted; `classes` (--classes) when given."""
    labels = {v for v in labels if v is not None and v != ""}
    numeric = all(as_int(v) is not None for v in labels)
    if not labelled:
        return [], numeric
    if classes is not None:
        return list(classes), numeric
    if numeric:
        return [str(i) for i in range(max((as_int(v) for v in labels), default=-1) + 1)], numeric
    return sorted({str(v) for v in labels}), numeric


@dataclass(frozen=True)
class ParquetShare:
    """Rows `rows` of a Parquet file (numbered in the file), in its row groups `row_groups`, the
    first of which starts at row `first_row`."""

    rows: range
    row_groups: range
    first_row: int


def parquet_share_labels(path: str, local, label_column: str, share: ParquetShare) -> set:
    """The distinct labels of a share of a Parquet manifest (its label column only)."""
    return {row[label_column] for row in _manifest_rows(path, local, {label_column: "label"}, [label_column], share)}


def parquet_share_records(
    path: str,
    local,
    classes: list[str],
    numeric: bool,
    path_column: str,
    label_column: str | None,
    root: str | None,
    url_list: bool,
    meta_columns: tuple[str, ...] | None,
    share: ParquetShare,
) -> Iterator[SourceRecord]:
    """The records of a share of a Parquet manifest, as `from_manifest` makes them (rows numbered
    in the file)."""
    typed = {path_column: "path", **({label_column: "label"} if label_column else {})}
    return _manifest_records(
        path, local, typed, classes, numeric, path_column, label_column, root, url_list, meta_columns, share
    )


@dataclass(frozen=True)
class FileRows:
    """How a listing's rows that name files become records: a path relative to the listing's
    folder resolves against it, and must lie inside the root (the folder unless --root says)."""

    root: str
    base: str
    inside: Callable[[str], bool]

    @classmethod
    def of(cls, listing: str, root: str | None) -> FileRows:
        base = listing.rsplit("/", 1)[0] if "/" in listing else "."
        return cls(root or base, base, root_check(root or base))

    def record(self, raw_path, label: int | None, meta: dict, where: str, missing: str) -> SourceRecord:
        """The row's record, with its problem if it has one: `missing` (the message) when it names
        no file, outside_root. `where`: the row, as messages name it."""
        source = resolve_path(str(raw_path or ""), self.base)
        record = SourceRecord(source, label, 0, meta, name=str(raw_path or ""))
        if not raw_path:
            record.problem = ("missing_path", missing)
        elif not self.inside(source):
            record.problem = (
                "outside_root",
                f"{where}: {display_path(str(raw_path))!r} resolves outside "
                f"{display_path(self.root)!r} (widen with --root)",
            )
        return record


def _manifest_records(
    path: str,
    local,
    typed: dict[str, str],
    classes: list[str],
    numeric: bool,
    path_column: str,
    label_column: str | None,
    root: str | None,
    url_list: bool,
    meta_columns: tuple[str, ...] | None,
    share: ParquetShare | None = None,
) -> Iterator[SourceRecord]:
    files = FileRows.of(path, root)
    ids = {name: i for i, name in enumerate(classes)}
    kept = (
        (lambda k: k in meta_columns) if meta_columns is not None else (lambda k: k not in (path_column, label_column))
    )
    try:
        for n, row in enumerate(_manifest_rows(path, local, typed, share=share), share.rows.start + 1 if share else 1):
            raw_path, raw_label = row.get(path_column), row.get(label_column)
            meta = {k: jsonable(v) for k, v in row.items() if kept(k)}
            label = label_id(raw_label, ids, numeric, len(classes)) if label_column else None
            missing = f"manifest row {n} has an empty {path_column!r}"
            record = (
                _url_record(raw_path, label, meta, n, missing)
                if url_list
                else files.record(raw_path, label, meta, f"manifest row {n}", missing)
            )
            if record.problem is None and label is None and label_column:
                record.problem = ("label_unknown", f"manifest row {n}: label {raw_label!r} is not in the class map")
            yield record
    finally:
        discard_copy(path, local)


def _url_record(raw_url, label: int | None, meta: dict, n: int, missing: str) -> SourceRecord:
    source = str(raw_url or "").strip()
    record = SourceRecord(source, label, 0, meta, name=str(raw_url or ""))
    hidden = without_userinfo(source)
    if not raw_url:
        record.problem = ("missing_path", missing)
    elif hidden != source:  # kept nowhere: not in the plan, the rejects or a log
        record.source = record.name = hidden
        record.problem = (
            "bad_url",
            f"manifest row {n}: a URL with user:password@ is not downloaded (credentials never come from a URL)",
        )
    elif not source.lower().startswith(("http://", "https://")):
        record.problem = ("bad_url", f"manifest row {n}: {display_path(source[:80])!r} is not an http(s) URL")
    return record


def discard_copy(path: str, local) -> None:
    if isinstance(local, str) and local != path:
        os.unlink(local)


def root_check(root: str):
    """A predicate: does a resolved source lie inside `root`? Local paths are compared after
    resolving `..` and symlinks, URLs by prefix after normalising `..`."""
    if is_url(root):
        prefix = root.rstrip("/") + "/"
        return lambda source: is_url(source) and _normalise_url(source).startswith(prefix)
    real_root = os.path.realpath(root.removeprefix("file://"))
    under_root = real_root.rstrip(os.sep) + os.sep
    # A manifest's rows share few folders: resolving each folder once, and only the last part of
    # each row (one lstat), is what keeps this at a few microseconds per row.
    real_folder = functools.lru_cache(maxsize=1 << 12)(os.path.realpath)

    def inside(source: str) -> bool:
        if is_url(source):
            return False
        folder, name = os.path.split(source)
        if name in ("", ".", "..") or os.path.islink(source):
            real = os.path.realpath(source)
        else:
            real = os.path.join(real_folder(folder), name)
        return real == real_root or real.startswith(under_root)

    return inside


def _normalise_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{posixpath.normpath(rest)}"


def label_id(raw, ids: dict[str, int], numeric: bool, num_classes: int) -> int | None:
    if raw in (None, ""):
        return None
    if numeric:
        value = as_int(raw)
        return value if value is not None and 0 <= value < num_classes else None
    return ids.get(str(raw))


def as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def resolve_path(path: str, base: str) -> str:
    """A row's path as a source: a URL with its `..` resolved (an object store would keep them in
    the name, and store URLs refuse them), a local path joined to the manifest's folder."""
    if is_url(path):
        return _normalise_url(path)
    if not path or path.startswith("/"):
        return path
    if path.startswith("file://"):
        return path[len("file://") :]
    return _normalise_url(posixpath.join(base, path)) if is_url(base) else os.path.join(base, path)


def jsonable(value):
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return str(value)
