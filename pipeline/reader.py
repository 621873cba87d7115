"""Read one rank's batch of encoded samples: bytes by offset, labels, sizes, crop windows.

Both backends start from the same RawBatch, so they see the same samples, in the same order,
with the same crop windows. Samples whose bytes are plainly broken (no JPEG start or end marker,
an unreadable header) are swapped here for a small blank image with label -1, which the loss
ignores: the batch keeps its size, every rank keeps its step count, the key is reported.
"""

from __future__ import annotations

import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import fsspec
import numpy as np
import simplejpeg
from PIL import Image

from vitforge.core import is_remote, with_retries

from .augment import Windows, crop_windows
from .index import DatasetIndex
from .order import RankSlice, epoch_order
from .spec import LoaderSpec

log = logging.getLogger("vitforge.pipeline")
IGNORE_LABEL = -1
BLANK_SIDE = 16


def _blank_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (BLANK_SIDE, BLANK_SIDE), (124, 116, 104)).save(out, "JPEG", quality=90)
    return out.getvalue()


BLANK_JPEG = _blank_jpeg()


@dataclass
class RawBatch:
    images: list[bytes]
    labels: np.ndarray  # int64; -1 for replaced samples (and eval padding)
    widths: np.ndarray
    heights: np.ndarray
    windows: Windows
    keys: list[str]
    bad: list[str] = field(default_factory=list)
    reads: tuple[int, int] = (0, 0)  # (object-store requests, bytes read) to make this batch

    def replace(self, i: int, reason: str) -> None:
        """Swap sample i for the blank image: label -1, full-frame window, no flip."""
        log.warning("bad sample %s replaced (label -1): %s", self.keys[i], reason)
        self.bad.append(self.keys[i])
        self.images[i] = BLANK_JPEG
        self.labels[i] = IGNORE_LABEL
        self.widths[i] = self.heights[i] = BLANK_SIDE
        for name, value in (("x", 0.0), ("y", 0.0), ("w", BLANK_SIDE), ("h", BLANK_SIDE)):
            getattr(self.windows, name)[i] = value
        self.windows.flip[i] = False


class SampleReader:
    """Byte ranges out of shards: pread on local files, ranged GETs (retried) on object stores."""

    def __init__(self, index: DatasetIndex, threads: int = 16):
        self.index = index
        self.remote = any(is_remote(u) for u in index.shard_urls)
        self._fds: dict[int, int] = {}
        self._pool = ThreadPoolExecutor(threads) if self.remote else None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, sample_ids: np.ndarray) -> list[bytes]:
        if self._pool is not None:
            return list(self._pool.map(self._read_one, sample_ids))
        return [self._read_one(s) for s in sample_ids]

    def _read_one(self, sample: int) -> bytes:
        index = self.index
        shard, start, length = int(index.shard[sample]), int(index.start[sample]), int(index.length[sample])
        url = index.shard_urls[shard]
        if not self.remote:
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = os.open(url.removeprefix("file://"), os.O_RDONLY)
            data = os.pread(fd, length, start)
        else:
            fs, path = fsspec.core.url_to_fs(url)
            data = with_retries(lambda: fs.cat_file(path, start=start, end=start + length), url)
        if len(data) != length:
            raise OSError(f"{url}: short read at byte {start} ({len(data)} of {length}): shard truncated?")
        return data


def image_size(data: bytes, max_pixels: int) -> tuple[int, int] | None:
    """(width, height) from the header, or None when the bytes cannot be an intact image or would
    decode to more than `max_pixels` (a decompression bomb: a 1 MB PNG can hold 3 GB of pixels)."""
    try:
        if data[:2] == b"\xff\xd8":
            if data.rfind(b"\xff\xd9", max(0, len(data) - 64)) < 0:
                return None  # no end-of-image marker: truncated
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        else:
            width, height = Image.open(io.BytesIO(data)).size
        return (width, height) if width * height <= max_pixels else None
    except Exception:  # any header the parsers refuse is a bad sample, whatever the exception
        return None


def make_batch(index: DatasetIndex, reader: SampleReader, order: np.ndarray, rank_slice: RankSlice,
               batch: int, spec: LoaderSpec, epoch: int) -> RawBatch:
    positions = rank_slice.positions(batch)
    sample_ids = order[positions % len(order)]
    regions = reader.read(sample_ids)
    images, labels, keys, label_texts = [], np.empty(len(regions), np.int64), [], []
    for i, (sample, region) in enumerate(zip(sample_ids, regions)):
        at, n = int(index.image_at[sample]), int(index.image_len[sample])
        images.append(region[at:at + n])
        label_at = int(index.label_at[sample])
        label_text = region[label_at:label_at + int(index.label_len[sample])]
        labels[i] = int(label_text) if label_text.strip().isdigit() else IGNORE_LABEL
        label_texts.append(label_text)
        keys.append(index.keys[sample])
    if not spec.train:
        labels[positions >= len(order)] = IGNORE_LABEL  # eval padding must not count twice
    sizes = [image_size(data, index.max_pixels) for data in images]
    widths = np.array([s[0] if s else BLANK_SIDE for s in sizes], np.int64)
    heights = np.array([s[1] if s else BLANK_SIDE for s in sizes], np.int64)
    raw = RawBatch(images, labels, widths, heights, crop_windows(widths, heights, positions, spec, epoch), keys,
                   reads=(len(sample_ids) if reader.remote else 0, sum(len(r) for r in regions)))
    for i, size in enumerate(sizes):
        if size is None:
            raw.replace(i, f"not an intact image (bad markers or header) or over {index.max_pixels} pixels")
        elif raw.labels[i] == IGNORE_LABEL and positions[i] < len(order):
            log.warning("sample %s: label %r is not a class id; it is ignored (label -1)", keys[i], label_texts[i])
            raw.bad.append(keys[i])
    return raw


def raw_batches(index: DatasetIndex, spec: LoaderSpec, epoch: int, rank_slice: RankSlice,
                batches: Iterable[int]) -> Iterator[RawBatch]:
    """The given batches of one rank's epoch, in that order, read with one reader."""
    order = epoch_order(index.shard, spec.seed, epoch, spec.shuffle_window)
    with SampleReader(index) as reader:
        for batch in batches:
            yield make_batch(index, reader, order, rank_slice, batch, spec, epoch)
