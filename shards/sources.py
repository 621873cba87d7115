"""List the inputs of a corpus: class-folder trees or CSV / JSONL / Parquet manifests, local or fsspec URLs.

The result is a list of SourceRecord in a stable order plus the class map (empty for an unlabelled
corpus: a folder of images at any depth, or a manifest without labels). Nothing here reads
image bytes; problems with individual rows (missing file, unknown label, a folder that cannot be
listed) travel with the record as `problem` so the sharder can count them as rejects instead of
failing the run. A manifest whose path or label column has the wrong type is not a bad row but a
bad manifest: the same mistake on every row, so it stops the run.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import posixpath
import stat
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec

from vitforge.core import StorageError, UsageError, with_retries
from vitforge.core import is_remote as is_url

log = logging.getLogger("vitforge.shard")

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}
MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
# What a manifest's path and label cells may hold (nulls aside: those rows are rejects).
EXPECTED_TYPES = {"path": "string", "label": "string (class name) or integer (class id)"}


class SourceError(UsageError):
    """The corpus as a whole cannot be read (not one bad sample: those become rejects)."""


@dataclass
class SourceRecord:
    source: str  # local path or fsspec URL; may hold surrogate escapes for non-UTF-8 names
    label: int | None  # None: the corpus is unlabelled, or (with a problem) the label is not in the class map
    size: int = 0  # bytes on the source, used to plan shard sizes; 0 when unknown
    meta: dict = field(default_factory=dict)
    problem: tuple[str, str] | None = None  # (reason, detail) when the row can never be packed
    name: str = ""  # the source as the corpus names it (path under SRC, or the manifest's path cell)

    def __post_init__(self):
        self.name = self.name or self.source


@dataclass
class Corpus:
    records: list[SourceRecord]
    classes: list[str]  # class id -> name; empty for an unlabelled corpus


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
    pre-training)."""
    if src.startswith("file://"):
        src = src[len("file://"):]
    if src.rstrip("/").lower().endswith(MANIFEST_SUFFIXES):
        corpus = _from_manifest(src, classes, path_column, label_column if labelled else None, root)
        _fill_sizes(corpus.records, stat_threads)
        return corpus
    files = _list_files(src, follow_symlinks, root)
    return _from_class_folders(src, files, classes) if labelled else _from_folder(src, files)


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


def _list_files(src: str, follow_symlinks: bool, root: str | None) -> list[tuple[str, str, int, tuple | None]]:
    """(path relative to src with "/" separators, path or URL to read, size, problem) of every file
    under src, and of every folder under it that cannot be listed (with its problem)."""
    if is_url(src):  # object stores have no links, and a listing error is the store's, for the whole run
        fs, top = fsspec.core.url_to_fs(src)
        found = fs.find(top, detail=True)
        return [(posixpath.relpath(p, top), fs.unstrip_protocol(p), info.get("size") or 0, None)
                for p, info in found.items() if info.get("type") != "directory"]
    if not os.path.isdir(src):
        raise SourceError(f"{src}: not a folder, and not a .csv/.jsonl/.parquet manifest")
    return [(_relative(p, src), p, size, problem)
            for p, size, problem in _walk_local(src, follow_symlinks, root or src)]


def _relative(path: str, src: str) -> str:
    return os.path.relpath(path, src).replace(os.sep, "/")


def _is_image(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in IMAGE_EXTENSIONS


def _from_folder(src: str, files: list) -> Corpus:
    records = [SourceRecord(url, None, size, problem=problem, name=rel)
               for rel, url, size, problem in sorted(files) if problem or _is_image(rel)]
    if not records:
        raise SourceError(f"{display_path(src)}: no images found under it")
    return Corpus(records, [])


def _from_class_folders(src: str, files: list, classes: list[str] | None) -> Corpus:
    by_class: dict[str, list] = {}
    for rel, url, size, problem in files:
        parts = rel.split("/")
        # An unlistable folder directly under SRC is still a class folder: its class keeps its id.
        if problem or (len(parts) >= 2 and _is_image(rel)):
            by_class.setdefault(parts[0], []).append((rel, url, size, problem))
    if not by_class:
        raise SourceError(f"{display_path(src)}: no images found in class folders (expected SRC/CLASS/IMAGE)")
    names = classes if classes is not None else sorted(by_class)
    ids = {name: i for i, name in enumerate(names)}
    records = []
    for name in sorted(by_class):
        for rel, url, size, problem in sorted(by_class[name]):
            record = SourceRecord(url, ids.get(name), size, problem=problem, name=rel)
            if record.label is None and not problem:
                record.problem = ("label_unknown", f"class folder {display_path(name)!r} is not in the class map")
            records.append(record)
    return Corpus(records, list(names))


def _walk_local(src: str, follow_symlinks: bool, boundary: str) -> list[tuple[str, int, tuple | None]]:
    """(path, size, problem) of every entry under src that is not a folder, and of every folder
    that cannot be listed. src itself may be a link. Symlinked folders below it are skipped unless
    `follow_symlinks`; then only those leading inside `boundary` are followed, after the real
    folders, so each real folder is listed once and, when src holds it, under its own name."""
    inside = _root_check(boundary)
    seen: set[tuple[int, int]] = set()
    found, not_followed, outside, repeated = [], [], [], []
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
                with os.scandir(folder) as it:
                    entries = sorted(it, key=lambda e: e.name)  # sorted: which link lists a folder is fixed
            except OSError as e:
                if folder == src:
                    raise  # nothing of the corpus can be read: an environment error for the whole run
                found.append((folder, 0, ("unreadable", f"folder cannot be listed: {type(e).__name__}: "
                                                        f"{e.strerror or e}")))
                continue
            subfolders = []
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=True)
                except OSError:
                    is_dir = False
                if is_dir and entry.is_symlink():
                    if not follow_symlinks:
                        not_followed.append(entry.path)
                    elif inside(entry.path):
                        links.append(entry.path)
                    else:
                        outside.append(entry.path)
                elif is_dir:
                    subfolders.append(entry.path)
                else:
                    try:
                        info = entry.stat(follow_symlinks=True)
                        size = info.st_size if stat.S_ISREG(info.st_mode) else 0
                    except OSError:
                        size = 0  # unreadable or a looping link: reading it later names the cause
                    found.append((entry.path, size, None))
            stack.extend(reversed(subfolders))
    _report_links(src, boundary, not_followed, outside, repeated)
    return found


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


def _read_manifest_rows(path: str, typed: dict[str, str]) -> list[dict]:
    """The rows, once the columns in `typed` (column -> "path" or "label") hold the types they must:
    checked in the Parquet schema, or in every JSON row (CSV cells are all strings)."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        # one thread: pyarrow's pool could abort the process at exit ("terminate called without an active exception")
        table = pq.read_table(io.BytesIO(read_source(path)), use_threads=False)
        for column, role in typed.items():
            if column in table.column_names and not _arrow_type_fits(table.schema.field(column).type, role):
                raise SourceError(f"{path}: column {column!r} has type {table.schema.field(column).type}; "
                                  f"expected {EXPECTED_TYPES[role]}")
        return table.to_pylist()
    text = read_source(path).decode("utf-8")  # a remote manifest is read whole, retried like any input
    if lower.endswith((".jsonl", ".json")):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
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
                rows.append(row)
        return rows
    return list(csv.DictReader(io.StringIO(text), delimiter="\t" if lower.endswith(".tsv") else ","))


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
    """`label_column` None: an unlabelled corpus; every column but the path is kept as metadata."""
    typed = {path_column: "path", **({label_column: "label"} if label_column else {})}
    try:
        rows = _read_manifest_rows(path, typed)
    except FileNotFoundError:
        raise SourceError(f"{path}: manifest not found") from None
    if not rows:
        raise SourceError(f"{path}: manifest has no rows")
    for column in (path_column, label_column) if label_column else (path_column,):
        if column not in rows[0]:
            raise SourceError(f"{path}: no column {column!r} (columns: {', '.join(map(str, rows[0]))})")
    base = path.rsplit("/", 1)[0] if "/" in path else "."
    inside = _root_check(root or base)
    labels = [row.get(label_column) for row in rows] if label_column else []
    numeric = all(_as_int(v) is not None for v in labels if v not in (None, ""))
    if not label_column:
        classes = []
    elif classes is None:
        if numeric:
            top = max((_as_int(v) for v in labels if v not in (None, "")), default=-1)
            classes = [str(i) for i in range(top + 1)]
        else:
            classes = sorted({str(v) for v in labels if v not in (None, "")})
    ids = {name: i for i, name in enumerate(classes)}
    records = []
    for n, row in enumerate(rows, 1):
        raw_path, raw_label = row.get(path_column), row.get(label_column)
        source = _resolve(str(raw_path or ""), base)
        meta = {k: _jsonable(v) for k, v in row.items() if k not in (path_column, label_column)}
        label = _label_id(raw_label, ids, numeric, len(classes)) if label_column else None
        record = SourceRecord(source, label, 0, meta, name=str(raw_path or ""))
        if not raw_path:
            record.problem = ("missing_path", f"manifest row {n} has an empty {path_column!r}")
        elif not inside(source):
            record.problem = ("outside_root", f"manifest row {n}: {display_path(str(raw_path))!r} resolves outside "
                                              f"{display_path(root or base)!r} (widen with --root)")
        elif label is None and label_column:
            record.problem = ("label_unknown", f"manifest row {n}: label {raw_label!r} is not in the class map")
        records.append(record)
    return Corpus(records, list(classes))


def _root_check(root: str):
    """A predicate: does a resolved source lie inside `root`? Local paths are compared after
    resolving `..` and symlinks, URLs by prefix after normalising `..`."""
    if is_url(root):
        prefix = root.rstrip("/") + "/"
        return lambda source: is_url(source) and _normalise_url(source).startswith(prefix)
    real_root = os.path.realpath(root.removeprefix("file://"))

    def inside(source: str) -> bool:
        if is_url(source):
            return False
        return os.path.commonpath([real_root, os.path.realpath(source)]) == real_root

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


def _fill_sizes(records: list[SourceRecord], threads: int) -> None:
    """Manifests carry no sizes; stat every source (in threads: S3 HEADs are latency-bound)."""
    def size_of(record: SourceRecord) -> int:
        if record.problem:
            return 0
        try:
            if is_url(record.source):
                fs, path = fsspec.core.url_to_fs(record.source)
                return int(fs.info(path).get("size") or 0)
            return os.stat(record.source).st_size
        except StorageError:
            raise  # the store itself failed: every later read would too
        except (OSError, ValueError):
            return 0  # reading it later names the cause

    with ThreadPoolExecutor(threads) as pool:
        for record, size in zip(records, pool.map(size_of, records)):
            record.size = size


def read_source(source: str) -> bytes:
    """The bytes of one input; remote reads are retried, local ones fail at once."""
    if not is_url(source):
        with open(source, "rb") as f:
            return f.read()

    def fetch() -> bytes:
        with fsspec.open(source, "rb") as f:
            return f.read()

    return with_retries(fetch, display_path(source))
