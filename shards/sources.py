"""List the inputs of a corpus: class-folder trees or CSV / JSONL / Parquet manifests, local or in a store.

The result is a stream of SourceRecord in a stable order plus the class map (empty for an unlabelled
corpus: a folder of images at any depth, or a manifest without labels). Nothing here holds the
whole listing: manifests are read row by row (Parquet by record batch), folder trees and object
store prefixes one folder at a time, so the caller decides how the records are kept (the planner keeps
them as columns); a manifest is read twice, a local folder tree listed twice. Nothing
here reads image bytes; problems with individual rows (missing file, unknown label, a folder that
cannot be listed) travel with the record as `problem` so the sharder can count them as rejects
instead of failing the run. A manifest whose path or label column has the wrong type is not a bad
row but a bad manifest: the same mistake on every row, so it stops the run.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
import posixpath
import stat
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from vitforge.core import StorageError, Store, UsageError, object_store, open_store
from vitforge.core import is_remote as is_url

from .parallel import ordered_map

log = logging.getLogger("vitforge.shard")

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}
MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
# What a manifest's path and label cells may hold (nulls aside: those rows are rejects).
EXPECTED_TYPES = {"path": "string", "label": "string (class name) or integer (class id)"}


class SourceError(UsageError):
    """The corpus as a whole cannot be read (not one bad sample: those become rejects)."""


@dataclass
class SourceRecord:
    source: str  # local path or store URL; may hold surrogate escapes for non-UTF-8 names
    label: int | None  # None: the corpus is unlabelled, or (with a problem) the label is not in the class map
    size: int = 0  # bytes on the source, used to plan shard sizes; 0 when unknown
    meta: dict = field(default_factory=dict)
    problem: tuple[str, str] | None = None  # (reason, detail) when the row can never be packed
    name: str = ""  # the source as the corpus names it (path under SRC, or the manifest's path cell)

    def __post_init__(self):
        self.name = self.name or self.source


@dataclass
class Corpus:
    """`records`: the listing in its stable order, streamed: iterate it once and keep what is needed
    (per input, a listing holds only the folders of a tree, the distinct labels of a manifest and
    a bounded window of records). `classes`: class id -> name, empty for an unlabelled corpus; for
    class folders without a class map it grows as the records are drawn, complete once they are."""
    records: Iterable[SourceRecord]
    classes: list[str]


def display_path(path: str) -> str:
    """A printable, valid-UTF-8 form of a path whose bytes may not be UTF-8."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def list_corpus(src: str, *, classes: list[str] | None = None, path_column: str = "path",
                label_column: str = "label", root: str | None = None, labelled: bool = True,
                follow_symlinks: bool = False, stat_threads: int = 32) -> Corpus:
    """`root`: for manifests, the folder (or URL prefix) every row must resolve inside; default the
    manifest's own folder, "/" for any local path. For a folder with `follow_symlinks`, the folder
    its followed links must lead into; default the folder itself. `labelled=False`: every image
    under a folder, at any depth, or every manifest row, without a label (for self-supervised
    pre-training). A manifest that cannot be read as a whole fails here; a folder tree that
    holds no images fails when its records run out."""
    if src.startswith("file://"):
        src = src[len("file://"):]
    if src.rstrip("/").lower().endswith(MANIFEST_SUFFIXES):
        corpus = _from_manifest(src, classes, path_column, label_column if labelled else None, root)
        return Corpus(_with_sizes(corpus.records, stat_threads), corpus.classes)
    if is_url(src):
        files = _remote_files(src, by_class=labelled)
    elif os.path.isdir(src):
        files = _local_files(src, follow_symlinks, root or src, by_class=labelled)
    else:
        raise SourceError(f"{src}: not a folder, and not a .csv/.jsonl/.parquet manifest")
    if not labelled:
        return Corpus(_from_folder(src, files), [])
    names = list(classes) if classes is not None else []
    return Corpus(_from_class_folders(src, files, classes, names), names)


def load_class_names(path: str) -> list[str]:
    """Class names from a text file (one per line), a JSON list/dict, or another dataset.json."""
    try:
        text = read_source(path).decode("utf-8")
    except FileNotFoundError:
        raise SourceError(f"{path}: class names file not found") from None
    except UnicodeDecodeError:
        raise SourceError(f"{path}: class names file is not UTF-8 text") from None
    if path.endswith(".json"):
        value = json.loads(text)
        value = value["classes"] if isinstance(value, dict) and "classes" in value else value
        if isinstance(value, dict):
            for name, number in value.items():
                if _as_int(number) is None:
                    raise SourceError(f"{path}: class {name!r} has id {_cell(number)}; expected integer")
            value = [name for name, _ in sorted(value.items(), key=lambda kv: _as_int(kv[1]))]
        if not isinstance(value, list):
            raise SourceError(f"{path}: expected a list of class names or a name -> id object")
        for i, name in enumerate(value):
            if not isinstance(name, str):
                raise SourceError(f"{path}: class {i} is {_cell(name)}; expected a string")
        names = value
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(set(names)) != len(names):
        raise SourceError(f"{path}: class names repeat")
    return names


FileEntry = tuple  # (path relative to src with "/" separators, path or URL to read, size, problem)


def _remote_files(src: str, by_class: bool) -> Iterator[FileEntry]:
    """Every object under src in the order sorting by relative path gives (by class folder name
    first when `by_class`), whatever the store: listed one folder at a time (`list_folder`), each
    folder sorted here (object stores do not all list in key order). Object stores have no links,
    and a listing error is the store's, for the whole run."""
    store = open_store(src)
    first = _store_folder(store, "", top_by_class=by_class)
    for name, size, _, _ in _depth_first(first, lambda folder: _store_folder(store, folder)):
        yield name, store.url(name), size, None


def _store_folder(store: Store, folder: str, top_by_class: bool = False) -> list:
    """(name, size, None, is_folder) of one folder's objects and subfolders, in relative-path order
    (as `_folder_entries`). `top_by_class`: only its subfolders, in name order."""
    subfolders, objects = store.list_folder(folder)
    base = f"{folder}/" if folder else ""
    if "" in subfolders:  # keys with "//": store names cannot address them, and listing "" again never ends
        log.warning("%s: objects under an empty path segment (a key with '//') are left out",
                    display_path(store.url(base + "/")))
        subfolders = [sub for sub in subfolders if sub]
    keyed = [(sub if top_by_class else sub + "/", (base + sub, 0, None, True)) for sub in subfolders]
    if not top_by_class:
        keyed += [(name, (base + name, size, None, False)) for name, size in objects.items()]
    keyed.sort(key=lambda k: k[0])
    return [item for _, item in keyed]


def _local_files(src: str, follow_symlinks: bool, boundary: str, by_class: bool) -> Iterator[FileEntry]:
    """Every file under src, and every folder under it that cannot be listed (with its problem), in
    the order sorting by relative path gives (by class folder name first when `by_class`, files
    directly in src left out). Two passes: `_listed_folders` decides which folders are listed and
    through which path (links and loops), then each is listed again, one folder at a time."""
    listed, unreadable = _listed_folders(src, follow_symlinks, boundary)
    first = _folder_entries(src, listed, unreadable, top_by_class=by_class)
    for path, size, problem, _ in _depth_first(first, lambda folder: _folder_entries(folder, listed, unreadable)):
        yield _relative(path, src), path, size, problem


def _depth_first(first: list, entries: Callable[[str], list]) -> Iterator[tuple]:
    """The non-folder entries (where, size, problem, is_folder) of a tree, each folder's `entries`
    expanded in its place: with each folder's entries sorted by name, a "/" after folder names,
    this is the order of the full relative paths. Holds one folder's entries per level."""
    stack = [iter(first)]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
        elif entry[3]:
            stack.append(iter(entries(entry[0])))
        else:
            yield entry


def _folder_entries(folder: str, listed: set[str], unreadable: dict[str, tuple], top_by_class: bool = False) -> list:
    """(path, size, problem, is_folder) of one folder's files, unreadable subfolders and subfolders
    to descend, in relative-path order. `top_by_class`: only its subfolders, in name order."""
    try:
        with os.scandir(folder) as it:
            scanned = list(it)
    except OSError as e:  # listed a moment ago: it changed since
        return [(folder, 0, _unlistable(e), False)]
    keyed = []
    for entry in scanned:
        if _is_folder(entry):
            if entry.path in listed:
                keyed.append((entry.name if top_by_class else entry.name + "/", (entry.path, 0, None, True)))
            elif entry.path in unreadable:
                keyed.append((entry.name, (entry.path, 0, unreadable[entry.path], False)))
        elif not top_by_class:
            try:
                info = entry.stat(follow_symlinks=True)
                size = info.st_size if stat.S_ISREG(info.st_mode) else 0
            except OSError:
                size = 0  # unreadable or a looping link: reading it later names the cause
            keyed.append((entry.name, (entry.path, size, None, False)))
    keyed.sort(key=lambda k: k[0])
    return [item for _, item in keyed]


def _unlistable(e: OSError) -> tuple[str, str]:
    return ("unreadable", f"folder cannot be listed: {type(e).__name__}: {e.strerror or e}")


def _relative(path: str, src: str) -> str:
    return os.path.relpath(path, src).replace(os.sep, "/")


def _is_image(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in IMAGE_EXTENSIONS


def _from_folder(src: str, files: Iterable[FileEntry]) -> Iterator[SourceRecord]:
    found = False
    for rel, url, size, problem in files:
        if problem or _is_image(rel):
            found = True
            yield SourceRecord(url, None, size, problem=problem, name=rel)
    if not found:
        raise SourceError(f"{display_path(src)}: no images found under it")


def _from_class_folders(src: str, files: Iterable[FileEntry], classes: list[str] | None,
                        names: list[str]) -> Iterator[SourceRecord]:
    """`files` come class by class in name order, so without a class map each class that holds
    an input takes the next id as its first input comes (appended to `names`): the ids sorting
    the class names would give."""
    ids = {name: i for i, name in enumerate(names)}
    found = False
    for rel, url, size, problem in files:
        name = rel.split("/", 1)[0]
        # An unlistable folder directly under SRC is still a class folder: its class keeps its id.
        if not (problem or ("/" in rel and _is_image(rel))):
            continue
        found = True
        if classes is None and name not in ids:
            ids[name] = len(names)
            names.append(name)
        record = SourceRecord(url, ids.get(name), size, problem=problem, name=rel)
        if record.label is None and not problem:
            record.problem = ("label_unknown", f"class folder {display_path(name)!r} is not in the class map")
        yield record
    if not found:
        raise SourceError(f"{display_path(src)}: no images found in class folders (expected SRC/CLASS/IMAGE)")


def _listed_folders(src: str, follow_symlinks: bool, boundary: str) -> tuple[set[str], dict[str, tuple]]:
    """The folders under src that are listed (by the path that lists them) and those that cannot
    be (path -> problem): a set of paths per folder, nothing per file. src itself may be a link.
    Symlinked folders below it are skipped unless `follow_symlinks`; then only those leading inside
    `boundary` are followed, after the real folders, so each real folder is listed once and, when
    src holds it, under its own name."""
    inside = _root_check(boundary)
    seen: set[tuple[int, int]] = set()
    listed: set[str] = set()
    unreadable: dict[str, tuple] = {}
    not_followed, outside, repeated = [], [], []
    links = deque([src])  # src, then each folder reached through a link, in the order they were found
    while links:
        stack = [links.popleft()]
        while stack:
            folder = stack.pop()
            try:
                st = os.stat(folder)
                if (st.st_dev, st.st_ino) in seen:
                    repeated.append(folder)  # a loop, or a second way into a folder already listed
                    continue
                seen.add((st.st_dev, st.st_ino))
                with os.scandir(folder) as it:  # sorted: which link lists a folder is fixed
                    folders = sorted((e for e in it if _is_folder(e)), key=lambda e: e.name)
            except OSError as e:
                if folder == src:
                    raise  # nothing of the corpus can be read: an environment error for the whole run
                unreadable[folder] = _unlistable(e)
                continue
            listed.add(folder)
            subfolders = []
            for entry in folders:
                if entry.is_symlink():
                    if not follow_symlinks:
                        not_followed.append(entry.path)
                    elif inside(entry.path):
                        links.append(entry.path)
                    else:
                        outside.append(entry.path)
                else:
                    subfolders.append(entry.path)
            stack.extend(reversed(subfolders))
    _report_links(src, boundary, not_followed, outside, repeated)
    return listed, unreadable


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=True)
    except OSError:
        return False


def _report_links(src: str, boundary: str, not_followed: list[str], outside: list[str], repeated: list[str]) -> None:
    def named(paths: list[str], target: bool = False) -> str:
        shown = [display_path(_relative(p, src)) + (f" -> {display_path(os.path.realpath(p))}" if target else "")
                 for p in paths[:5]]
        return ", ".join(shown) + (f", and {len(paths) - 5} more" if len(paths) > 5 else "")

    if not_followed:
        log.warning("skipped %d symlinked folders under %s (%s): folder links are followed only with "
                    "--follow-symlinks", len(not_followed), display_path(src), named(not_followed))
    if outside:
        log.warning("skipped %d symlinked folders that lead outside %s (%s): widen with --root",
                    len(outside), display_path(os.path.realpath(boundary)), named(outside, target=True))
    if repeated:
        log.info("%d symlinked folders lead to folders already listed (%s); each is listed once",
                 len(repeated), named(repeated))


def _manifest_rows(path: str, local: str, typed: dict[str, str], columns: list[str] | None = None) -> Iterator[dict]:
    """The rows of the manifest `path` (read from `local`), once the columns in `typed` (column ->
    "path" or "label") hold the types they must: checked in the Parquet schema, or in every JSON
    row (CSV cells are all strings). Streamed: a line, or a Parquet record batch, at a time.
    `columns`: read only these columns (Parquet only: a CSV or JSON row holds all of its own)."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        with pq.ParquetFile(local) as table:
            schema = table.schema_arrow
            for column, role in typed.items():
                if column in schema.names and not _arrow_type_fits(schema.field(column).type, role):
                    raise SourceError(f"{path}: column {column!r} has type {schema.field(column).type}; "
                                      f"expected {EXPECTED_TYPES[role]}")
            # one thread: pyarrow's pool could abort the process at exit ("terminate called without an
            # active exception")
            for batch in table.iter_batches(batch_size=8192, columns=columns, use_threads=False):
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
        raise SourceError(f"{path}:{n}: not a JSON object but {_cell(row)}")
    for column, role in typed.items():
        if not _value_fits(row.get(column), role):
            raise SourceError(f"{path}:{n}: column {column!r} is {_cell(row[column])}; "
                              f"expected {EXPECTED_TYPES[role]}")
    return row


def _manifest_summary(path: str, local: str, typed: dict[str, str],
                      label_column: str | None) -> tuple[list | None, set]:
    """The first pass: the first row's columns (None: no rows) and the distinct labels, after every
    row passed the checks of `_manifest_rows` (so a bad row stops the run before any record)."""
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        with pq.ParquetFile(local) as table:
            names = table.schema_arrow.names if table.metadata.num_rows else None
        labels = set()
        if names is not None and label_column in names:  # the label column alone: cheap
            labels.update(row[label_column] for row in _manifest_rows(path, local, typed, [label_column]))
        return names, labels
    first, labels = None, set()
    for row in _manifest_rows(path, local, typed):
        first = first if first is not None else list(row)
        if label_column:
            labels.add(row.get(label_column))
    return first, labels


def _local_manifest(path: str) -> str:
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


def _cell(value) -> str:
    """A JSON value's type and a short form of it, for an error message."""
    kinds = {type(None): "null", bool: "a boolean", int: "an integer", float: "a float", str: "a string",
             list: "an array", dict: "an object"}
    shown = repr(value)
    return f"{kinds.get(type(value), type(value).__name__)} ({shown[:40] + '...' if len(shown) > 40 else shown})"


def _from_manifest(path: str, classes: list[str] | None, path_column: str, label_column: str | None,
                   root: str | None) -> Corpus:
    """`label_column` None: an unlabelled corpus; every column but the path is kept as metadata.
    Two passes over the manifest: the first checks every row and collects the distinct labels (the
    class map must be known before the first record: ids come from all labels, sorted), the
    second makes the records. Per input nothing is kept but the distinct labels."""
    typed = {path_column: "path", **({label_column: "label"} if label_column else {})}
    try:
        local = _local_manifest(path)
    except FileNotFoundError:
        raise SourceError(f"{path}: manifest not found") from None
    try:
        try:
            columns, labels = _manifest_summary(path, local, typed, label_column)
        except FileNotFoundError:
            raise SourceError(f"{path}: manifest not found") from None
        if columns is None:
            raise SourceError(f"{path}: manifest has no rows")
        for column in (path_column, label_column) if label_column else (path_column,):
            if column not in columns:
                raise SourceError(f"{path}: no column {column!r} (columns: {', '.join(map(str, columns))})")
    except BaseException:
        _discard_copy(path, local)
        raise
    labels.discard(None)
    labels.discard("")
    numeric = all(_as_int(v) is not None for v in labels)
    if not label_column:
        classes = []
    elif classes is None:
        if numeric:
            top = max((_as_int(v) for v in labels), default=-1)
            classes = [str(i) for i in range(top + 1)]
        else:
            classes = sorted({str(v) for v in labels})
    return Corpus(_manifest_records(path, local, typed, classes, numeric, path_column, label_column, root),
                  list(classes))


def _manifest_records(path: str, local: str, typed: dict[str, str], classes: list[str], numeric: bool,
                      path_column: str, label_column: str | None, root: str | None) -> Iterator[SourceRecord]:
    base = path.rsplit("/", 1)[0] if "/" in path else "."
    inside = _root_check(root or base)
    ids = {name: i for i, name in enumerate(classes)}
    try:
        for n, row in enumerate(_manifest_rows(path, local, typed), 1):
            raw_path, raw_label = row.get(path_column), row.get(label_column)
            source = _resolve(str(raw_path or ""), base)
            meta = {k: _jsonable(v) for k, v in row.items() if k not in (path_column, label_column)}
            label = _label_id(raw_label, ids, numeric, len(classes)) if label_column else None
            record = SourceRecord(source, label, 0, meta, name=str(raw_path or ""))
            if not raw_path:
                record.problem = ("missing_path", f"manifest row {n} has an empty {path_column!r}")
            elif not inside(source):
                record.problem = ("outside_root", f"manifest row {n}: {display_path(str(raw_path))!r} resolves "
                                                  f"outside {display_path(root or base)!r} (widen with --root)")
            elif label is None and label_column:
                record.problem = ("label_unknown", f"manifest row {n}: label {raw_label!r} is not in the class map")
            yield record
    finally:
        _discard_copy(path, local)


def _discard_copy(path: str, local: str) -> None:
    if local != path:
        os.unlink(local)


def _root_check(root: str):
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


def _label_id(raw, ids: dict[str, int], numeric: bool, num_classes: int) -> int | None:
    if raw in (None, ""):
        return None
    if numeric:
        value = _as_int(raw)
        return value if value is not None and 0 <= value < num_classes else None
    return ids.get(str(raw))


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _resolve(path: str, base: str) -> str:
    if not path or is_url(path) or path.startswith("/"):
        return path
    if path.startswith("file://"):
        return path[len("file://"):]
    return posixpath.join(base, path) if is_url(base) else os.path.join(base, path)


def _jsonable(value):
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _with_sizes(records: Iterable[SourceRecord], threads: int) -> Iterator[SourceRecord]:
    """Manifests carry no sizes; stat every source (in threads: S3 HEADs are latency-bound)."""
    def sized(record: SourceRecord) -> SourceRecord:
        record.size = _size_of(record)
        return record

    # Bounded: pool.map would hold a future per record (~0.5 KB each, GBs at paper scale).
    return ordered_map(sized, records, threads, chunk_size=64, window_per_worker=2, threads=True)


def _size_of(record: SourceRecord) -> int:
    if record.problem:
        return 0
    try:
        if is_url(record.source):
            store, name = object_store(record.source)
            return store.stat(name).size
        return os.stat(record.source).st_size
    except StorageError:
        raise  # the store itself failed: every later read would too
    except (OSError, ValueError):
        return 0  # reading it later names the cause


def read_source(source: str) -> bytes:
    """The bytes of one input; remote reads are retried (by the store), local ones fail at once
    with the file's own error (an unreadable image is a reject, not a failed store)."""
    if not is_url(source):
        with open(source, "rb") as f:
            return f.read()
    store, name = object_store(source)
    return store.get_bytes(name)
