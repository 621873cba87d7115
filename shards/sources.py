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

import json
import logging
import os
from collections.abc import Iterable, Iterator

from vitforge.core import StorageError, object_store
from vitforge.core import is_remote as is_url

from .folders import from_class_folders, from_folder, local_files, remote_files
from .hf_parquet import from_hf_parquet
from .manifests import as_int, cell, from_manifest
from .parallel import ordered_map
from .records import Corpus, SourceError, SourceRecord, display_path

__all__ = ["Corpus", "SourceError", "SourceRecord", "display_path", "list_corpus", "load_class_names", "read_source"]

log = logging.getLogger("vitforge.shard")


MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


def list_corpus(
    src: str,
    *,
    classes: list[str] | None = None,
    path_column: str = "path",
    label_column: str = "label",
    root: str | None = None,
    labelled: bool = True,
    follow_symlinks: bool = False,
    stat_threads: int = 32,
    url_list: bool = False,
    meta_columns: tuple[str, ...] | None = None,
    image_column: str | None = None,
) -> Corpus:
    """`root`: for manifests, the folder (or URL prefix) every row must resolve inside; default the
    manifest's own folder, "/" for any local path. For a folder with `follow_symlinks`, the folder
    its followed links must lead into; default the folder itself. `labelled=False`: every image
    under a folder, at any depth, or every manifest row, without a label (for self-supervised
    pre-training). `url_list`: `src` is a manifest whose path column holds http(s) URLs to download
    (sizes stay 0: nothing is fetched while listing); `meta_columns`: the manifest columns kept in
    each sample's JSON (default all but path and label). `image_column`: `src` is a Parquet file
    in the Hugging Face `datasets` layout with its images in this column. A manifest that cannot be read as a whole
    fails here; a folder tree that holds no images fails when its records run out."""
    if src.startswith("file://"):
        src = src[len("file://") :]
    if image_column:
        if not src.lower().endswith(".parquet"):
            raise SourceError(f"{src}: --image-col reads a Parquet file (the datasets Image layout)")
        return from_hf_parquet(src, classes, image_column, label_column if labelled else None, root, meta_columns)
    if src.rstrip("/").lower().endswith(MANIFEST_SUFFIXES):
        corpus = from_manifest(
            src, classes, path_column, label_column if labelled else None, root, url_list, meta_columns
        )
        return corpus if url_list else Corpus(with_sizes(corpus.records, stat_threads), corpus.classes)
    if url_list:
        raise SourceError(f"{src}: a URL list must be a .csv/.tsv/.jsonl/.parquet manifest")
    if is_url(src):
        files = remote_files(src, by_class=labelled)
    elif os.path.isdir(src):
        files = local_files(src, follow_symlinks, root or src, by_class=labelled)
    else:
        raise SourceError(f"{src}: not a folder, and not a .csv/.jsonl/.parquet manifest")
    if not labelled:
        return Corpus(from_folder(src, files), [])
    names = list(classes) if classes is not None else []
    return Corpus(from_class_folders(src, files, classes, names), names)


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
                if as_int(number) is None:
                    raise SourceError(f"{path}: class {name!r} has id {cell(number)}; expected integer")
            value = [name for name, _ in sorted(value.items(), key=lambda kv: as_int(kv[1]))]
        if not isinstance(value, list):
            raise SourceError(f"{path}: expected a list of class names or a name -> id object")
        for i, name in enumerate(value):
            if not isinstance(name, str):
                raise SourceError(f"{path}: class {i} is {cell(name)}; expected a string")
        names = value
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(set(names)) != len(names):
        raise SourceError(f"{path}: class names repeat")
    return names


def with_sizes(records: Iterable[SourceRecord], threads: int = 32) -> Iterator[SourceRecord]:
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
