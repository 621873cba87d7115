"""Where every sample lives: shard, byte range of its image and label, from the DALI index files.

A dataset is labelled (every sample has a .cls member) or not (none needs one: sharded with
--no-labels, or tars whose first sample has none); an unlabelled sample's range is its image's.

With offsets known up front, a loader reads exactly the samples it wants, in the order it wants,
without scanning tars: that is what makes the epoch order ours (deterministic, equal per rank,
resumable to the sample) instead of a property of a streaming reader.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import numpy as np
from braceexpand import braceexpand
from PIL import Image

from vitforge.core import UsageError, atomic_write, is_remote, open_store, with_retries
from vitforge.shards import SAMPLE_IMAGE_EXTS, ManifestError, index_path_for, index_tar, read_manifest

from .cache import locked

log = logging.getLogger("vitforge.pipeline")


class DatasetError(UsageError):
    pass


@dataclass
class DatasetIndex:
    shard_urls: list[str]
    shard: np.ndarray  # int32, per sample
    start: np.ndarray  # int64: first byte of the range holding the image and the label
    length: np.ndarray  # int64: bytes in that range
    image_at: np.ndarray  # int64: image offset within the range
    image_len: np.ndarray  # int64
    label_at: np.ndarray  # int64
    label_len: np.ndarray  # int64 (0 in an unlabelled dataset)
    keys: list[str]
    num_classes: int | None  # from dataset.json; None for shards made elsewhere, and unlabelled ones
    labelled: bool = True
    classes: list[str] | None = None  # class id -> name, from dataset.json
    # Larger images are bad samples (decompression bombs): the sharder's --max-pixels, or
    # Pillow's default guard for shards made elsewhere.
    max_pixels: int = Image.MAX_IMAGE_PIXELS
    # Each shard's sha256 from dataset.json (None for tars made elsewhere): a cached copy of a shard
    # is only ever one of these bytes, even when a dataset is rewritten at the same URL.
    shard_sha256: list[str] | None = None
    shard_bytes: list[int] | None = None  # each shard's size from dataset.json, with its sha256

    def __len__(self) -> int:
        return len(self.keys)

    def select(self, ids: np.ndarray) -> "DatasetIndex":
        """The index of these samples only (ascending ids); shards and class map unchanged."""
        columns = {k: getattr(self, k)[ids] for k in ("shard", "start", "length", "image_at", "image_len",
                                                       "label_at", "label_len")}
        return DatasetIndex(self.shard_urls, keys=[self.keys[i] for i in ids], num_classes=self.num_classes,
                            labelled=self.labelled, classes=self.classes, max_pixels=self.max_pixels,
                            shard_sha256=self.shard_sha256, shard_bytes=self.shard_bytes,
                            **columns)


def load_index(dataset: str, cache_folder: str | None = None) -> DatasetIndex:
    """`dataset`: a folder or s3:// prefix with dataset.json, or tar paths (a glob or
    `{000000..000099}` braces) made by any WebDataset writer, with or without .idx files.
    `cache_folder`: a node's shard cache folder for an s3:// dataset with dataset.json; one rank of
    the node fetches the index files and keeps them beside it, the others read them there."""
    if dataset.rstrip("/").endswith(".tar") or any(c in dataset for c in "*?{"):
        urls = _expand(dataset)
        if not urls:
            raise DatasetError(f"{dataset}: no tar files match")
        return _build(urls, [_index_text(u) for u in urls], None, None, scanned=True)
    store = open_store(dataset)
    try:
        manifest = read_manifest(store)
    except ManifestError as e:
        raise DatasetError(str(e)) from None
    urls = [store.url(s["name"]) for s in manifest["shards"]]
    texts = _index_texts(store, manifest, cache_folder if is_remote(dataset) else None)
    index = _build(urls, texts, manifest["num_classes"], manifest["num_classes"] is not None)
    index.classes = manifest.get("classes")
    index.shard_sha256 = [s["sha256"] for s in manifest["shards"]]
    index.shard_bytes = [s["bytes"] for s in manifest["shards"]]
    index.max_pixels = manifest.get("parameters", {}).get("image", {}).get("max_pixels") or index.max_pixels
    if len(index) != manifest["totals"]["samples"]:
        raise DatasetError(f"{dataset}: index files list {len(index)} samples, dataset.json says "
                           f"{manifest['totals']['samples']}")
    return index


def _index_texts(store, manifest: dict, cache_folder: str | None) -> list[str]:
    """The shards' index files, fetched in parallel (one GET each on a store), or the node's copy."""
    def fetch() -> list[str]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda s: store.get_bytes(s["index"]).decode(), manifest["shards"]))

    if cache_folder is None:
        return fetch()
    listing = json.dumps(manifest["shards"], sort_keys=True).encode()
    path = f"{cache_folder}-index-{hashlib.sha1(listing).hexdigest()[:12]}.json"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with locked(path + ".lock"):
        if not os.path.exists(path):
            atomic_write(path, json.dumps(fetch()).encode())
    with open(path) as f:
        return json.load(f)


def _expand(pattern: str) -> list[str]:
    urls = []
    for path in braceexpand(pattern):
        is_glob = "://" not in path and any(c in path for c in "*?[")
        urls += glob.glob(path) if is_glob else [path]
    return sorted(set(urls))


def _index_text(url: str) -> str:
    idx = index_path_for(url)

    def read() -> str:
        with fsspec.open(idx, "rt") as f:
            return f.read()

    try:
        return with_retries(read, idx) if is_remote(idx) else read()  # a body cut short is read again
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


def _build(urls: list[str], texts: list[str], num_classes: int | None, labelled: bool | None,
           scanned: bool = False) -> DatasetIndex:
    """`labelled` None: as the first sample says. `scanned`: the index texts may come from scanning
    the tars, so errors name the tar."""
    columns: dict[str, list[int]] = {k: [] for k in ("shard", "start", "length", "image_at", "image_len",
                                                     "label_at", "label_len")}
    keys: list[str] = []
    for shard, (url, text) in enumerate(zip(urls, texts)):
        where = url if scanned and not os.path.exists(index_path_for(url)) else index_path_for(url)
        lines = text.splitlines()
        if not lines or not lines[0].startswith("v1."):
            raise DatasetError(f"{where}: not a DALI index file")
        for n, line in enumerate(lines[1:], 2):
            fields = line.split(" ")
            members = {fields[i]: (int(fields[i + 1]), int(fields[i + 2]), fields[i + 3])
                       for i in range(0, len(fields) - 3, 4)}
            image_ext = next((e for e in SAMPLE_IMAGE_EXTS if e in members), None)
            if labelled is None:
                labelled = "cls" in members
            if image_ext is None or (labelled and "cls" not in members):
                sample = next(iter(members.values()))[2].split(".", 1)[0] if members else f"line {n}"
                missing = "image (.jpg/.png/.webp)" if image_ext is None else ".cls label"
                raise DatasetError(f"{where}: sample {sample} has no {missing} member "
                                   f"(members: {', '.join(sorted(members)) or 'none'})")
            image_off, image_len, name = members[image_ext]
            label_off, label_len, _ = members["cls"] if labelled else (image_off, 0, "")
            start = min(image_off, label_off)
            columns["shard"].append(shard)
            columns["start"].append(start)
            columns["length"].append(max(image_off + image_len, label_off + label_len) - start)
            columns["image_at"].append(image_off - start)
            columns["image_len"].append(image_len)
            columns["label_at"].append(label_off - start)
            columns["label_len"].append(label_len)
            keys.append(f"{os.path.basename(url)}:{name.split('.', 1)[0]}")
    arrays = {k: np.asarray(v, dtype=np.int32 if k == "shard" else np.int64) for k, v in columns.items()}
    if not keys:
        raise DatasetError("the dataset has no samples")
    return DatasetIndex(urls, keys=keys, num_classes=num_classes, labelled=labelled, **arrays)
