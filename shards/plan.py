"""Turn a listed corpus into a shard plan: dedup, seeded global shuffle, cut into shards.

The plan depends only on the listing, the seed and the size policy, never on worker count or
timing, so every shard can be built independently: by any worker count, by any part of a job
array, or again after a crash, and always to the same bytes. Shard boundaries come from source
sizes (known before decoding), which is why a shard's final size only approximates the target
when images are re-encoded or resized.

A folder or a Parquet list is planned in shares by the whole job array (shards/array_plan.py):
there the sorted inputs are split into `buckets_for(N)` buckets of about BUCKET_INPUTS by the
keys' top bits (one below that, so a small corpus is cut as a whole, as here), and each bucket is
cut on its own, at the price of one short shard per bucket (0.1% more shards at 10,000 a shard).

Scale: only the planner holds the whole listing, as columns (`Inputs`: about 50 bytes per input
plus its source path and metadata as UTF-8, no Python object per input). It writes the plan as
plan_slices.py reads it: slices first, the header last.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .digests import DigestTable, Duplicate, content_digests, within
from .layout import FIRST, Work, shard_name
from .parallel import ordered_map
from .plan_slices import PlanHeader, part_range
from .sources import Corpus, SourceRecord, read_source

# Per-sample tar overhead beyond the image: three headers, the .cls and .json members, padding.
SAMPLE_OVERHEAD = 4 * 512
_CUT_CHUNK = 1 << 16  # positions turned into Python ints at a time while cutting shards
BUCKET_INPUTS = 1 << 20  # the inputs a bucket holds, on average (the shuffle keys are uniform)
SUB_BUCKETS = 4096  # buckets are runs of these, by the keys' top 12 bits: a spill's sections


class Inputs:
    """The listing in listing order, as columns. Per input: 16 bytes of shuffle key (computed as
    it is added, so the name is not kept), a 4-byte label, an 8-byte size, two 8-byte offsets,
    the source path and the metadata JSON as bytes; problems (rare) in a dict."""

    def __init__(self, seed: int):
        self._seed = str(seed).encode()
        self._keys = bytearray()
        self._sources, self._source_ends = bytearray(), array("q")
        self._metas, self._meta_ends = bytearray(), array("q")
        self.labels = array("i")  # -1: no label
        self.sizes = array("q")
        self.problems: dict[int, tuple[str, ...]] = {}  # (reason, detail)

    @classmethod
    def of(cls, records: Iterable[SourceRecord], seed: int) -> Inputs:
        inputs = cls(seed)
        for record in records:
            inputs.add(record)
        return inputs

    def __len__(self) -> int:
        return len(self.labels)

    def add(self, record: SourceRecord) -> None:
        if record.problem:
            self.problems[len(self.labels)] = tuple(record.problem)
        if record.group:  # sorted by group first, then by name within it
            self._keys += _shuffle_key(self._seed, record.group)[:8] + _shuffle_key(self._seed, record.name)[:8]
        else:
            self._keys += _shuffle_key(self._seed, record.name)
        # surrogatepass: any Python string round-trips, surrogate-escaped file names included.
        self._sources += record.source.encode("utf-8", "surrogatepass")
        self._source_ends.append(len(self._sources))
        if record.meta:
            self._metas += json.dumps(record.meta, separators=(",", ":")).encode()
        self._meta_ends.append(len(self._metas))
        self.labels.append(-1 if record.label is None else record.label)
        self.sizes.append(record.size)

    def source(self, i: int) -> str:
        start = self._source_ends[i - 1] if i else 0
        return self._sources[start : self._source_ends[i]].decode("utf-8", "surrogatepass")

    def line(self, i: int, shard: int, position: int) -> bytes:
        """Row `i` as one JSON-lines row of a plan slice (read back by plan_slices.py's `load_slice`)."""
        return b'[%d,"%09d",%s' % (shard, position, self.tail(i))

    def tail(self, i: int) -> bytes:
        """Row `i`'s line after its shard and position: source, label, meta, problem."""
        start = self._meta_ends[i - 1] if i else 0
        meta = self._metas[start : self._meta_ends[i]] or b"{}"
        label = self.labels[i]
        problem = self.problems.get(i)
        return b"%s,%s,%s,%s]\n" % (
            json.dumps(self.source(i)).encode(),
            b"null" if label < 0 else b"%d" % label,
            meta,
            json.dumps(list(problem)).encode() if problem else b"null",
        )

    def keys(self) -> np.ndarray:
        """(N, 2) big-endian uint64: sorting rows by them sorts by the 16-byte keys."""
        return np.frombuffer(self._keys, dtype=">u8").reshape(-1, 2)  # a view: add nothing while it lives

    def nbytes(self) -> int:
        return (
            len(self._keys)
            + len(self._sources)
            + len(self._metas)
            + 8 * len(self._source_ends)
            + 8 * len(self._meta_ends)
            + 4 * len(self.labels)
            + 8 * len(self.sizes)
        )


@dataclass
class Plan:
    """The whole plan, held by the planner only: the columns plus two int64 arrays (8 bytes per
    kept input for the order, 8 per shard for the boundaries) and the duplicates' rows."""

    fingerprint: str
    parameters: dict
    classes: list[str]
    inputs: Inputs
    order: np.ndarray  # position in the shuffled plan -> row of `inputs`
    bounds: np.ndarray  # shard i holds positions bounds[i]:bounds[i + 1]
    duplicates: list[Duplicate]  # listing order
    digests: DigestTable | None = None  # the kept inputs' content, when the plan deduplicated
    first_shard: int = 0
    first_position: int = 0

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    def header(self, parts: int) -> PlanHeader:
        return PlanHeader(
            self.fingerprint,
            self.parameters,
            self.classes,
            len(self.inputs),
            self.num_shards,
            parts,
            len(self.duplicates),
            self.first_shard,
            self.first_position,
        )

    def slice_bytes(self, part: int, parts: int) -> bytes:
        """One line per item: [shard, key, source, label, meta, problem] (meta spliced as stored)."""
        lines = [
            self.inputs.line(int(self.order[position]), self.first_shard + shard, self.first_position + position)
            for shard in part_range(self.num_shards, part, parts)
            for position in range(self.bounds[shard], self.bounds[shard + 1])
        ]
        return gzip.compress(b"".join(lines), compresslevel=1, mtime=0)  # mtime=0: the same bytes each run

    def duplicates_bytes(self) -> bytes:
        lines = [
            json.dumps(
                {
                    "source": self.inputs.source(row),
                    "duplicate_of": first if isinstance(first, str) else self.inputs.source(first),
                    "sha256": digest,
                },
                sort_keys=True,
            ).encode()
            + b"\n"
            for row, first, digest in self.duplicates
        ]
        return gzip.compress(b"".join(lines), mtime=0)


def write_plan(store, plan: Plan, parts: int, threads: int = 8, work: Work = FIRST) -> PlanHeader:
    """Slices, duplicates and digests first, the header last; at most 2 x `threads` slices in memory."""

    def put(part: int) -> None:
        store.put_bytes(work.slice(part), plan.slice_bytes(part, parts))

    for _ in ordered_map(put, range(parts), threads, chunk_size=1, window_per_worker=2, threads=True):
        pass
    store.put_bytes(work.duplicates, plan.duplicates_bytes())
    if plan.digests is not None:
        store.put_bytes(work.digests, plan.digests.to_bytes())
    header = plan.header(parts)
    store.put_bytes(work.header, header.to_bytes())
    return header


def synthetic_inputs(n: int, seed: int = 0, num_classes: int = 1000, mean_bytes: int = 110_000) -> Inputs:
    """`n` made-up inputs (ImageNet-like paths and sizes, nothing on disk): what a benchmark plans
    to measure the planner at scale without listing a corpus."""
    inputs = Inputs(seed)
    for i in range(n):
        label = i % num_classes
        name = f"n{label:08d}/n{label:08d}_{i:09d}.JPEG"
        inputs.add(
            SourceRecord(f"/data/train/{name}", label, mean_bytes // 2 + (i * 2654435761) % mean_bytes, name=name)
        )
    return inputs


def fingerprint(parameters: dict) -> str:
    return hashlib.sha256(json.dumps(parameters, sort_keys=True).encode()).hexdigest()[:16]


def make_plan(
    corpus: Corpus,
    parameters: dict,
    *,
    seed: int,
    shard_bytes: int | None,
    shard_samples: int | None,
    dedup: bool,
    threads: int = 8,
) -> Plan:
    return plan_inputs(
        Inputs.of(corpus.records, seed),
        corpus.classes,
        parameters,
        shard_bytes=shard_bytes,
        shard_samples=shard_samples,
        dedup=dedup,
        threads=threads,
    )


def plan_inputs(
    inputs: Inputs,
    classes: list[str],
    parameters: dict,
    *,
    shard_bytes: int | None,
    shard_samples: int | None,
    dedup: bool,
    threads: int = 8,
    read: Callable[[str], bytes] = read_source,
    existing: DigestTable | None = None,
    first_shard: int = 0,
    first_position: int = 0,
) -> Plan:
    """`read`: how dedup gets an input's bytes (a benchmark passes synthetic content). `existing`:
    the digests of the dataset this plan extends; an input whose content it holds is a duplicate
    of that sample, named "SHARD#KEY" (an extension always deduplicates)."""
    duplicates: list[Duplicate] = []
    digests = None
    if dedup:
        duplicates, digests, valid = _duplicates(inputs, parameters, threads, read, existing)
    kept = np.ones(len(inputs), dtype=bool)
    kept[[row for row, _, _ in duplicates]] = False
    rows = np.flatnonzero(kept)
    keys = inputs.keys()[rows]
    # lexsort is stable: equal keys (a name listed twice) keep listing order, as sorted() did.
    order = rows[np.lexsort((keys[:, 1], keys[:, 0]))]
    del keys
    bounds = cut(np.frombuffer(inputs.sizes, dtype=np.int64), order, shard_bytes, shard_samples)
    table = None
    if digests is not None:
        positions = np.flatnonzero(valid[order])
        shards = np.searchsorted(bounds, positions, side="right") - 1
        table = DigestTable.of(digests[order[positions]], first_shard + shards, first_position + positions)
    return Plan(
        fingerprint(parameters),
        parameters,
        classes,
        inputs,
        order,
        bounds,
        duplicates,
        table,
        first_shard,
        first_position,
    )


def _duplicates(
    inputs: Inputs, parameters: dict, threads: int, read: Callable[[str], bytes], existing: DigestTable | None
) -> tuple[list[Duplicate], np.ndarray, np.ndarray]:
    """(duplicates in listing order, every row's content digest, whether the row has one): rows whose
    content `existing` holds, then rows whose content an earlier row has."""
    duplicates: list[Duplicate] = []
    digests, valid = content_digests(len(inputs), _readable(inputs), threads, read)
    rows = np.flatnonzero(valid)
    if existing is not None:
        found = existing.find(digests[rows])
        prefix = parameters["prefix"]
        duplicates = [
            (
                int(row),
                f"{shard_name(prefix, int(existing.records['shard'][at]))}#{int(existing.records['position'][at]):09d}",
                digests[row].tobytes().hex(),
            )
            for row, at in zip(rows[found >= 0], found[found >= 0])
        ]
        rows = rows[found < 0]
    return sorted(duplicates + within(digests, rows), key=lambda d: d[0]), digests, valid


def buckets_for(inputs: int) -> int:
    return min(SUB_BUCKETS, max(1, -(-inputs // BUCKET_INPUTS)))


def bucket_sub_buckets(bucket: int, buckets: int) -> range:
    """The sub-buckets (top 12 key bits) that make up `bucket`: runs of them, so bucket order is
    key order."""
    return range(-(-bucket * SUB_BUCKETS // buckets), -(-(bucket + 1) * SUB_BUCKETS // buckets))


def cut(sizes: np.ndarray, order: np.ndarray, shard_bytes: int | None, shard_samples: int | None) -> np.ndarray:
    """Shard boundaries: a shard closes at `shard_samples`, or before the input that would take it
    past `shard_bytes` (a single larger input still gets a shard)."""
    bounds = [0]
    count = total = 0
    for start in range(0, len(order), _CUT_CHUNK):
        for position, size in enumerate((sizes[order[start : start + _CUT_CHUNK]] + SAMPLE_OVERHEAD).tolist(), start):
            if (shard_samples and count >= shard_samples) or (shard_bytes and count and total + size > shard_bytes):
                bounds.append(position)
                count = total = 0
            count += 1
            total += size
    if len(order):
        bounds.append(len(order))
    return np.asarray(bounds, dtype=np.int64)


def _shuffle_key(seed: bytes, name: str) -> bytes:
    # A keyed hash of the name within the corpus, instead of random.shuffle: stable across Python
    # versions, listing order, and where the corpus is mounted.
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), key=seed, digest_size=16).digest()


def deduplicate(inputs: Inputs, threads: int, read: Callable[[str], bytes] = read_source) -> list[Duplicate]:
    """Exact duplicates by content sha256 within `inputs`, the first in listing order kept: (row,
    row kept, sha256 hex) in listing order."""
    digests, valid = content_digests(len(inputs), _readable(inputs), threads, read)
    return within(digests, np.flatnonzero(valid))


def _readable(inputs: Inputs) -> Callable[[int], str | None]:
    """A row's source to hash, or None for a row with a problem (rejected with it when packed)."""
    return lambda row: None if row in inputs.problems else inputs.source(row)
