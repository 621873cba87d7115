"""Where every sample lives: shard, byte range of its image and label, from the DALI index files.

A dataset is labelled (every sample has a .cls member) or not (none needs one: sharded with
--no-labels, or tars whose first sample has none); an unlabelled sample's range is its image's.

With offsets known up front, a loader reads exactly the samples it wants, in the order it wants,
without scanning tars: that is what makes the epoch order ours (deterministic, equal per rank,
resumable to the sample) instead of a property of a streaming reader.

What a rank holds: one row per shard from dataset.json (URL, sample count, size, sha256: about
300 bytes a shard, 9 MB for 30,000 shards), and the samples' byte ranges of the shards it reads
only, loaded when its order needs them (about 100 bytes a sample: 60 MB for 586,000 samples, one
GET per shard). Tars without dataset.json have no sample counts anywhere else: every index file
is read at start (datasets of that kind are small, or should be resharded).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from braceexpand import braceexpand
from PIL import Image

from vitforge.core import UsageError, is_remote, object_store, open_store
from vitforge.shards import (
    MANIFEST_NAME,
    SAMPLE_IMAGE_EXTS,
    ManifestError,
    index_path_for,
    index_tar,
    manifest_version,
    read_manifest,
)

from .order import ranked_subset_ids, subset_counts, subset_rows

log = logging.getLogger("vitforge.pipeline")
COLUMNS = ("start", "length", "image_at", "image_len", "label_at", "label_len")


class DatasetError(UsageError):
    pass


@dataclass
class ShardSamples:
    """One shard's samples (a subset's only, for a subset): byte ranges and names, about 100 bytes
    a sample."""

    start: np.ndarray  # int64: first byte of the range holding the image and the label
    length: np.ndarray  # int64: bytes in that range
    image_at: np.ndarray  # int64: image offset within the range
    image_len: np.ndarray  # int64
    label_at: np.ndarray  # int64
    label_len: np.ndarray  # int64 (0 in an unlabelled dataset)
    names: list[str]

    def rows(self, keep: np.ndarray) -> ShardSamples:
        # (the six COLUMNS in field order: mypy cannot count a starred generator)
        return ShardSamples(*(getattr(self, c)[keep] for c in COLUMNS), names=[self.names[i] for i in keep])  # type: ignore[misc]

    @property
    def end(self) -> int:
        """Bytes from the shard's start to the end of its last sample: what a cache needs of it."""
        return int((self.start + self.length).max()) if len(self.start) else 0


@dataclass
class Subset:
    """Which rows of each shard a subset keeps: `counts` per shard (O(shards)), the rows chosen
    per shard when it is loaded; `ranked`: version 2's rows, from one ranking of all samples."""

    size: float | int
    seed: int
    counts: np.ndarray
    ranked: dict[int, np.ndarray] | None = None

    def rows(self, full_counts: np.ndarray, shard: int) -> np.ndarray:
        if self.ranked is not None:
            return self.ranked.get(shard, np.empty(0, np.int64))
        return subset_rows(full_counts, shard, int(self.counts[shard]), self.seed)


@dataclass
class DatasetIndex:
    """The shards' table (see the module's docstring for what it costs) and the samples of the
    shards loaded so far."""

    shard_urls: list[str]
    shard_samples: np.ndarray  # int64: samples per shard (in the subset, for a subset)
    num_classes: int | None  # from dataset.json; None for shards made elsewhere, and unlabelled ones
    labelled: bool | None = True  # None until the first sample of tars made elsewhere says
    classes: list[str] | None = None  # class id -> name, from dataset.json
    # Larger images are bad samples (decompression bombs): the sharder's --max-pixels, or
    # Pillow's default guard for shards made elsewhere.
    max_pixels: int = Image.MAX_IMAGE_PIXELS
    # Each shard's sha256 from dataset.json (None for tars made elsewhere): a cached copy of a shard
    # is only ever one of these bytes, even when a dataset is rewritten at the same URL.
    shard_sha256: list[str] | None = None
    shard_bytes: list[int] | None = None  # each shard's size from dataset.json, with its sha256
    subset: Subset | None = None
    # Shard number -> the text of its index file (one GET for a stored dataset).
    index_text: Callable[[int], str] | None = field(default=None, repr=False)
    whole: DatasetIndex | None = field(default=None, repr=False)  # for a subset: the dataset it is of
    loaded: dict[int, ShardSamples] = field(default_factory=dict, repr=False)
    # Samples per class id from dataset.json, for the whole dataset (None for a subset, whose counts
    # are known only once its samples are read, and for tars made elsewhere): O(classes).
    class_counts: list[int] | None = field(default=None, repr=False)
    # The dataset.json version read (`vitforge shard --extend` adds versions); None for tars made elsewhere.
    version: int | None = None

    def __len__(self) -> int:
        return int(self.shard_samples.sum())

    @property
    def ranked(self) -> bool:
        """A subset drawn as loader state version 2 drew them (with_subset(ranked=True))."""
        return self.subset is not None and self.subset.ranked is not None

    def samples(self, shard: int) -> ShardSamples:
        return self.loaded[shard]

    def key(self, shard: int, row: int) -> str:
        return f"{os.path.basename(self.shard_urls[shard])}:{self.loaded[shard].names[row]}"

    def load(self, shards: Iterable[int]) -> None:
        """Read the index files of these shards (16 at a time), unless already loaded."""
        wanted = [int(s) for s in shards if int(s) not in self.loaded]
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(self.index_text, wanted))
        for shard, text in zip(wanted, texts):
            self._add(shard, text)

    def _add(self, shard: int, text: str) -> None:
        where = _where_scanned(self.shard_urls[shard])
        samples, self.labelled = _parse(where, text, self.labelled)
        full = self.shard_samples if self.whole is None else self.whole.shard_samples
        if len(samples.start) != full[shard]:
            raise DatasetError(f"{where}: lists {len(samples.start)} samples, dataset.json says {full[shard]}")
        self.loaded[shard] = samples if self.subset is None else samples.rows(self.subset.rows(full, shard))

    def with_subset(self, size: float | int, seed: int, ranked: bool = False) -> DatasetIndex:
        """This dataset's deterministic subset (order.subset_counts), or with `ranked` version 2's
        (order.ranked_subset_ids: O(N) once, for resuming a run that began with it)."""
        whole = self.whole or self
        full = whole.shard_samples
        if ranked:
            ids = ranked_subset_ids(int(full.sum()), size, seed)  # ascending
            offsets = np.cumsum(full) - full
            per_shard = np.split(ids, np.searchsorted(ids, offsets[1:]))
            rows = {s: kept - offsets[s] for s, kept in enumerate(per_shard) if len(kept)}
            subset = Subset(size, seed, np.array([len(kept) for kept in per_shard], np.int64), rows)
        else:
            subset = Subset(size, seed, subset_counts(full, size, seed))
        index = DatasetIndex(
            whole.shard_urls,
            subset.counts,
            whole.num_classes,
            whole.labelled,
            whole.classes,
            whole.max_pixels,
            whole.shard_sha256,
            whole.shard_bytes,
            subset,
            whole.index_text,
            whole,
            version=whole.version,
        )
        for shard, samples in whole.loaded.items():  # tars without dataset.json: loaded at start
            index.loaded[shard] = samples.rows(subset.rows(full, shard))
        return index


def load_index(dataset: str) -> DatasetIndex:
    """`dataset`: a folder or s3:// prefix with dataset.json, or tar paths (a glob or
    `{000000..000099}` braces) made by any WebDataset writer, with or without .idx files. Samples
    are loaded per shard, with DatasetIndex.load (tars without dataset.json: all at once, here)."""
    if dataset.rstrip("/").endswith(".tar") or any(c in dataset for c in "*?{"):
        urls = _expand(dataset)
        if not urls:
            raise DatasetError(f"{dataset}: no tar files match")
        index = DatasetIndex(
            urls,
            np.zeros(len(urls), np.int64),
            None,
            labelled=None,
            index_text=functools.partial(_scanned_text, tuple(urls)),
        )
        texts = [_scanned_text(tuple(urls), s) for s in range(len(urls))]
        for shard, text in enumerate(texts):
            samples, index.labelled = _parse(_where_scanned(urls[shard]), text, index.labelled)
            index.loaded[shard], index.shard_samples[shard] = samples, len(samples.start)
        if not len(index):
            raise DatasetError("the dataset has no samples")
        return index
    folder, name = _manifest_of(dataset)
    store = open_store(folder)
    try:
        manifest = read_manifest(store, name)
    except ManifestError as e:
        raise DatasetError(str(e)) from None
    shards = manifest["shards"]
    index = DatasetIndex(
        [store.url(s["name"]) for s in shards],
        np.array([s["samples"] for s in shards], np.int64),
        manifest["num_classes"],
        labelled=manifest["num_classes"] is not None,
        classes=manifest.get("classes"),
        class_counts=manifest.get("class_counts"),
        max_pixels=manifest.get("parameters", {}).get("image", {}).get("max_pixels") or Image.MAX_IMAGE_PIXELS,
        shard_sha256=[s["sha256"] for s in shards],
        shard_bytes=[s["bytes"] for s in shards],
        index_text=StoredIndexFiles(folder, tuple(s["index"] for s in shards), store),
        version=manifest.get("version", 1),
    )
    if len(index) != manifest["totals"]["samples"]:
        raise DatasetError(
            f"{dataset}: its shards list {len(index)} samples, dataset.json says {manifest['totals']['samples']}"
        )
    if not len(index):
        raise DatasetError(f"{dataset}: the dataset has no samples")
    return index


def _manifest_of(dataset: str) -> tuple[str, str]:
    """(folder, manifest name): a folder reads its latest version (dataset.json); naming a version's
    manifest, FOLDER/dataset.vN.json, pins that version's shards."""
    folder, _, name = dataset.rstrip("/").rpartition("/")
    if name.endswith(".json"):
        if name != MANIFEST_NAME and manifest_version(name) is None:
            raise DatasetError(
                f"{dataset}: a dataset is a folder holding {MANIFEST_NAME}, or one version's manifest "
                "in it (dataset.v1.json, dataset.v2.json, ...)"
            )
        return folder or ".", name
    return dataset, MANIFEST_NAME


class StoredIndexFiles:
    """A dataset.json dataset's index files by shard number: one GET each (retried by the store).
    Pickles without its store: a loader worker started by spawn or forkserver opens its own."""

    def __init__(self, dataset: str, names: tuple[str, ...], store=None):
        self.dataset, self.names, self.store = dataset, names, store

    def __getstate__(self) -> dict:
        return {"dataset": self.dataset, "names": self.names, "store": None}

    def __call__(self, shard: int) -> str:
        if self.store is None:
            self.store = open_store(self.dataset)
        try:
            return self.store.get_bytes(self.names[shard]).decode()
        except FileNotFoundError:
            raise DatasetError(
                f"{self.store.url(self.names[shard])}: index file missing (listed in dataset.json)"
            ) from None


def _expand(pattern: str) -> list[str]:
    urls = []
    for path in braceexpand(pattern):
        is_glob = "://" not in path and any(c in path for c in "*?[")
        urls += glob.glob(path) if is_glob else [path]
    return sorted(set(urls))


def _where_scanned(url: str) -> str:
    """What an error names: the index file, or the tar when it has none (it was scanned)."""
    return index_path_for(url) if is_remote(url) or os.path.exists(index_path_for(url)) else url


def _scanned_text(urls: tuple[str, ...], shard: int) -> str:
    """A tar's index file, or, for a local tar without one, its scan."""
    url = urls[shard]
    idx = index_path_for(url)
    store, name = object_store(idx)
    try:
        return store.get_bytes(name).decode()  # the store reads again a body cut short
    except FileNotFoundError:
        pass
    if is_remote(url):
        raise DatasetError(f"{url}: no index file {idx}; make one with DALI's `wds2idx` (scanning remote tars is slow)")
    log.info("%s: no index file, scanning the tar", url)
    try:
        return index_tar(url).decode()
    except FileNotFoundError:
        raise DatasetError(f"{url}: no such file") from None
    except ValueError as e:
        raise DatasetError(str(e)) from None


def _parse(where: str, text: str, labelled: bool | None) -> tuple[ShardSamples, bool | None]:
    """One DALI index file's samples, and whether the dataset is labelled (`labelled` None: as
    this file's first sample says). Errors name `where`."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("v1."):
        raise DatasetError(f"{where}: not a DALI index file")
    columns = np.empty((len(lines) - 1, len(COLUMNS)), np.int64)
    names = []
    for n, line in enumerate(lines[1:]):
        fields = line.split(" ")
        members = {
            fields[i]: (int(fields[i + 1]), int(fields[i + 2]), fields[i + 3]) for i in range(0, len(fields) - 3, 4)
        }
        image_ext = next((e for e in SAMPLE_IMAGE_EXTS if e in members), None)
        if labelled is None:
            labelled = "cls" in members
        if image_ext is None or (labelled and "cls" not in members):
            sample = next(iter(members.values()))[2].split(".", 1)[0] if members else f"line {n + 2}"
            missing = "image (.jpg/.png/.webp)" if image_ext is None else ".cls label"
            raise DatasetError(
                f"{where}: sample {sample} has no {missing} member (members: {', '.join(sorted(members)) or 'none'})"
            )
        image_off, image_len, name = members[image_ext]
        label_off, label_len, _ = members["cls"] if labelled else (image_off, 0, "")
        start = min(image_off, label_off)
        columns[n] = (
            start,
            max(image_off + image_len, label_off + label_len) - start,
            image_off - start,
            image_len,
            label_off - start,
            label_len,
        )
        names.append(name.split(".", 1)[0])
    # (the six COLUMNS in field order: mypy cannot count a starred generator)
    return ShardSamples(*(columns[:, i].copy() for i in range(len(COLUMNS))), names=names), labelled  # type: ignore[misc, arg-type]
