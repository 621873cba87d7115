"""Read one rank's batch of encoded samples: bytes by offset, labels, sizes, crop windows.

Both backends start from the same RawBatch, so they see the same samples, in the same order,
with the same crop windows. Samples whose bytes are plainly broken (no JPEG start or end marker,
an unreadable header) are swapped here for a small blank image with label -1, which the loss
ignores: the batch keeps its size, every rank keeps its step count, the key is reported. `real`
marks the samples that are neither such blanks nor eval padding: an unlabelled dataset's samples
all carry label -1, so a self-supervised loss goes by `real` instead.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import simplejpeg
from PIL import Image

from vitforge.core import is_remote

from . import randaugment
from .augment import Windows, crop_windows
from .cache import NEVER, CacheSpec, ShardCache, ShardFile, StreamedShard, cache_spec, shard_file_name
from .index import DatasetIndex
from .order import EpochOrder, RankSlice, partition_shards_of, shard_uses
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
    positions: np.ndarray  # int64: each sample's position in the epoch's order (what augmentation hashes)
    real: np.ndarray  # bool: False for replaced samples and eval padding
    bad: list[str] = field(default_factory=list)
    # RandAugment's plan, (samples, operations) each: indices into randaugment.OPS, and negated or not
    augment_ops: np.ndarray | None = None
    augment_negate: np.ndarray | None = None
    # What reading this batch cost: object-store requests and bytes (or bytes read locally), and
    # shard-cache opens and fetches.
    reads: dict = field(default_factory=lambda: {"requests": 0, "bytes": 0, "opens": 0, "fetches": 0})

    def replace(self, i: int, reason: str) -> None:
        """Swap sample i for the blank image: label -1, full-frame window, no flip."""
        log.warning("bad sample %s replaced (label -1): %s", self.keys[i], reason)
        self.bad.append(self.keys[i])
        self.images[i] = BLANK_JPEG
        self.labels[i] = IGNORE_LABEL
        self.real[i] = False
        self.widths[i] = self.heights[i] = BLANK_SIDE
        for name, value in (("x", 0.0), ("y", 0.0), ("w", BLANK_SIDE), ("h", BLANK_SIDE)):
            getattr(self.windows, name)[i] = value
        self.windows.flip[i] = False


class SampleReader:
    """Byte ranges out of shards by offset: local shards are read in place; object-store shards
    through the node's shard cache, fetched ahead of need (or from the store, when the node's disk
    cannot hold them). A shard's file is closed after the last batch of the plan that reads it, so
    the cache may reclaim it."""

    def __init__(
        self,
        index: DatasetIndex,
        plan: list[tuple[np.ndarray, np.ndarray]],
        cache: CacheSpec | None = None,
        node_future: NodeFuture | None = None,
    ):
        """`plan`: each batch's (shard, row) per sample. `cache` and `node_future`: for object-store
        shards (see raw_batches), else None."""
        self.index = index
        self._plan = plan
        self._open: dict[int, ShardFile | StreamedShard] = {}
        shards_of = [np.unique(shards).tolist() for shards, _ in plan]
        last_use = {s: i for i, shards in enumerate(shards_of) for s in shards}
        self._closing = [[s for s in shards if last_use[s] == i] for i, shards in enumerate(shards_of)]
        # Shards in the order the plan first reads them; known[i]: how many of them batch i has reached.
        self._upcoming: list[int] = []
        self._known: list[int] = []
        seen: set[int] = set()
        for shards in shards_of:
            self._upcoming += [s for s in shards if s not in seen]
            seen.update(shards)
            self._known.append(len(self._upcoming))
        self._cache = self._prefetcher = None
        self._batch = self._batch_position = self._submitted = 0
        self._pending: list[tuple[int, Future]] = []  # read-ahead on its way: (place in _upcoming, future)
        self._skipped: list[int] = []  # read-ahead the cache had no room for (places in _upcoming)
        if cache is not None:
            names = {shard_file_name(*self._identity(s)): s for s in node_future.shards}
            self._cache = ShardCache(cache, lambda name: node_future.next_use(names.get(name), self._batch_position))
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")
        self._counted = self._counters()

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SampleReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, shards: np.ndarray, rows: np.ndarray, position: int) -> tuple[list[bytes], dict]:
        """The samples' byte ranges, and what reading them cost: {"requests", "bytes"} from the store
        (or bytes read locally), {"opens", "fetches"} of cached shards since the previous batch."""
        if self._cache is not None:
            self._batch_position = position
            self._prefetch_ahead()
        regions = [self._read_one(int(s), int(r)) for s, r in zip(shards, rows)]
        for shard in self._closing[self._batch]:
            self._open.pop(shard).close()
        self._batch += 1
        # Since the previous batch's count, not since this batch began: what the prefetch thread
        # fetched while the consumer decoded counts too.
        after = self._counters()
        reads = {k: after[k] - self._counted[k] for k in after}
        self._counted = after
        if self._cache is None:
            reads["bytes"] = sum(len(r) for r in regions)
        return regions, reads

    def _counters(self) -> dict:
        cache = self._cache
        if cache is None:
            return {"requests": 0, "bytes": 0, "opens": 0, "fetches": 0}
        return {
            "requests": cache.requests,
            "bytes": cache.bytes_fetched,
            "opens": cache.opens,
            "fetches": cache.fetches,
        }

    def _prefetch_ahead(self) -> None:
        """Keep the shards of this batch and the next `ahead` ones (in first-use order) on their way;
        read-ahead the cache had no room for is asked again, while its shard is still ahead."""
        wanted = min(len(self._upcoming), self._known[self._batch] + self._cache.spec.ahead)
        ahead = self._known[self._batch]
        self._skipped += [
            u
            for u, future in self._pending
            if future.done() and future.exception() is None and future.result() is False
        ]
        self._pending = [(u, future) for u, future in self._pending if not future.done()]
        again = []
        # Asked again only when this reader reaches a new shard (room is made as shards are left),
        # not at every batch: each ask takes the folder's lock.
        if self._batch == 0 or ahead != self._known[self._batch - 1]:
            again, self._skipped = [u for u in self._skipped if u >= ahead], []
        for u in again + list(range(self._submitted, wanted)):
            self._pending.append((u, self._prefetcher.submit(self._cache.prefetch, *self._identity(self._upcoming[u]))))
        self._submitted = max(self._submitted, wanted)

    def _identity(self, shard: int) -> tuple[str, int, str | None]:
        """(URL, bytes to fetch, sha256 or None): what names a shard in the cache. With dataset.json
        the whole tar, whose sha256 it gives (the last sample's .json and the tar's end are a few KB);
        else up to the end of its last sample."""
        if self.index.shard_sha256:
            return self.index.shard_urls[shard], self.index.shard_bytes[shard], self.index.shard_sha256[shard]
        return self.index.shard_urls[shard], self.index.samples(shard).end, None

    def _read_one(self, shard: int, row: int) -> bytes:
        index = self.index
        samples = index.samples(shard)
        start, length = int(samples.start[row]), int(samples.length[row])
        source = self._open.get(shard)
        if source is None:
            url = index.shard_urls[shard]
            source = self._open[shard] = (
                self._cache.open(*self._identity(shard))
                if self._cache is not None
                else ShardFile(os.open(url.removeprefix("file://"), os.O_RDONLY))
            )
            if isinstance(source, StreamedShard):
                source.expect(self._upcoming_reads(shard))
        data = source.pread(length, start)
        if len(data) != length:
            raise OSError(
                f"{index.shard_urls[shard]}: short read at byte {start} ({len(data)} of {length}): shard truncated?"
            )
        return data

    def _upcoming_reads(self, shard: int) -> list[tuple[int, int]]:
        """(offset, length) of every read of `shard` from the current batch on, in read order: what
        a streamed shard requests ahead. O(the plan's samples) once per streamed shard."""
        samples = self.index.samples(shard)
        rows = [r for shards, rows in self._plan[self._batch :] for r in rows[shards == shard].tolist()]
        return [(int(samples.start[r]), int(samples.length[r])) for r in rows]


class NodeFuture:
    """When this node next reads each shard in the rest of the epoch, from the (first, last)
    positions at which the partitions its ranks read use each shard (order.shard_uses): O(shards
    of those partitions), about 500 a node at 30,000 shards over 64 nodes."""

    def __init__(self, index: DatasetIndex, spec: LoaderSpec, epoch: int, rank_slice: RankSlice):
        counts, partitions = index.shard_samples, rank_slice.partitions
        ranks = rank_slice.node_ranks()
        parts = np.unique(np.concatenate([rank_slice.partitions_read(r, padding=False) for r in ranks]))
        self.uses = shard_uses(counts, spec.seed, epoch, spec.shuffle_window, partitions, parts)
        past = rank_slice.end - len(index)
        if past > 0:  # padding reads the order's first `past` positions again, at positions N on
            padded = np.unique(np.concatenate([rank_slice.partitions_read(r) for r in ranks]))
            for shard, spans in shard_uses(
                counts, spec.seed, epoch, spec.shuffle_window, partitions, padded, below=past, shift=len(index)
            ).items():
                self.uses.setdefault(shard, []).extend(spans)
        self.shards = sorted(self.uses)

    def next_use(self, shard: int | None, position: int) -> float:
        if shard is None:
            return NEVER  # not a shard this node reads this epoch (another's, or left by an earlier run)
        ahead = [max(first, position) for first, last in self.uses.get(shard, ()) if last >= position]
        return float(min(ahead)) if ahead else NEVER


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


def make_batch(
    index: DatasetIndex,
    reader: SampleReader,
    located: tuple[np.ndarray, np.ndarray],
    positions: np.ndarray,
    spec: LoaderSpec,
    epoch: int,
) -> RawBatch:
    """One batch: the samples at `positions` of the epoch, found at `located` (shard, row each)."""
    shards, rows = located
    regions, reads = reader.read(shards, rows, int(positions[0]))
    images, labels, keys, label_texts = [], np.empty(len(regions), np.int64), [], []
    for i, (shard, row, region) in enumerate(zip(shards.tolist(), rows.tolist(), regions)):
        samples = index.samples(shard)
        at, n = int(samples.image_at[row]), int(samples.image_len[row])
        images.append(region[at : at + n])
        label_at = int(samples.label_at[row])
        label_text = region[label_at : label_at + int(samples.label_len[row])]
        labels[i] = int(label_text) if index.labelled and label_text.strip().isdigit() else IGNORE_LABEL
        label_texts.append(label_text)
        keys.append(index.key(shard, row))
    real = np.ones(len(regions), bool)
    if not spec.train:
        real[positions >= len(index)] = False  # eval padding must not count twice
        labels[~real] = IGNORE_LABEL
    sizes = [image_size(data, index.max_pixels) for data in images]
    widths = np.array([s[0] if s else BLANK_SIDE for s in sizes], np.int64)
    heights = np.array([s[1] if s else BLANK_SIDE for s in sizes], np.int64)
    raw = RawBatch(
        images,
        labels,
        widths,
        heights,
        crop_windows(widths, heights, positions, spec, epoch),
        keys,
        positions,
        real,
        reads=reads,
    )
    if spec.train and spec.randaugment:
        raw.augment_ops, raw.augment_negate = randaugment.plan(spec.seed, epoch, positions, spec.randaugment[0])
    for i, size in enumerate(sizes):
        if size is None:
            raw.replace(i, f"not an intact image (bad markers or header) or over {index.max_pixels} pixels")
        elif index.labelled and raw.labels[i] == IGNORE_LABEL and positions[i] < len(index):
            log.warning("sample %s: label %r is not a class id; it is ignored (label -1)", keys[i], label_texts[i])
            raw.bad.append(keys[i])
    return raw


def rank_order(index: DatasetIndex, spec: LoaderSpec, epoch: int, rank_slice: RankSlice) -> EpochOrder:
    """The epoch's order at this rank's positions, with the index of the shards they read loaded:
    made once per rank and epoch (a backend's workers share it), from the rank's partitions alone."""
    parts = rank_slice.partitions_read()
    index.load(partition_shards_of(index.shard_samples, spec.seed, rank_slice.partitions, parts))
    return EpochOrder(index.shard_samples, spec.seed, epoch, spec.shuffle_window, rank_slice.partitions, parts)


def raw_batches(
    index: DatasetIndex,
    spec: LoaderSpec,
    epoch: int,
    rank_slice: RankSlice,
    batches: Iterable[int],
    order: EpochOrder | None = None,
) -> Iterator[RawBatch]:
    """The given batches of one rank's epoch, in that order, read with one reader; `order`: the
    rank's rank_order, when the caller made it already."""
    order = order or rank_order(index, spec, epoch, rank_slice)
    batches = list(batches)
    plan = [order.at(rank_slice.positions(b)) for b in batches]
    cache = future = None
    if any(is_remote(u) for u in index.shard_urls):
        cache = cache_spec(spec, rank_slice.rank // rank_slice.ranks_per_node)
        future = NodeFuture(index, spec, epoch, rank_slice)
    with SampleReader(index, plan, cache, future) as reader:
        for batch, located in zip(batches, plan):
            yield make_batch(index, reader, located, rank_slice.positions(batch), spec, epoch)
