"""Turn a listed corpus into a shard plan: dedup, seeded global shuffle, cut into shards.

The plan depends only on the listing, the seed and the size policy, never on worker count or
timing, so every shard can be built independently: by any worker count, by any part of a job
array, or again after a crash, and always to the same bytes. Shard boundaries come from source
sizes (known before decoding), which is why a shard's final size only approximates the target
when images are re-encoded or resized.

Scale: only the planner holds the whole listing, as columns (`Inputs`: about 50 bytes per input
plus its source path and metadata as UTF-8, no Python object per input). It stores the plan as
one gzip'd JSON-lines slice per part and a small header written last (the commit mark), so a
task reads only the slices that hold its shards and a plan cut short is never taken for complete.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from array import array
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from vitforge.core import UsageError

from .parallel import ordered_map
from .sources import Corpus, SourceRecord, read_source

# Per-sample tar overhead beyond the image: three headers, the .cls and .json members, padding.
SAMPLE_OVERHEAD = 4 * 512
PLAN_DIR = "_work/plan"
HEADER_NAME = f"{PLAN_DIR}/header.json"  # written last: a plan without it does not exist
DUPLICATES_PLAN = f"{PLAN_DIR}/duplicates.jsonl.gz"
LEGACY_PLAN_NAME = "_work/plan.json.gz"  # one file holding everything (vitforge before plan slices)
PLAN_FORMAT = "vitforge.shard-plan"
PLAN_FORMAT_VERSION = 2
_CUT_CHUNK = 1 << 16  # positions turned into Python ints at a time while cutting shards


def slice_name(part: int) -> str:
    return f"{PLAN_DIR}/part-{part:05d}.jsonl.gz"


@dataclass
class PlanItem:
    key: str
    source: str
    label: int | None
    meta: dict = field(default_factory=dict)
    problem: list | None = None


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
        self.problems: dict[int, tuple[str, str]] = {}

    @classmethod
    def of(cls, records: Iterable[SourceRecord], seed: int) -> "Inputs":
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
        return self._sources[start:self._source_ends[i]].decode("utf-8", "surrogatepass")

    def line(self, i: int, shard: int, position: int) -> bytes:
        """Row `i` as one JSON-lines row of a plan slice (read back by `load_slice`)."""
        start = self._meta_ends[i - 1] if i else 0
        meta = self._metas[start:self._meta_ends[i]] or b"{}"
        label = self.labels[i]
        problem = self.problems.get(i)
        return b'[%d,"%09d",%s,%s,%s,%s]\n' % (shard, position, json.dumps(self.source(i)).encode(),
                                                 b"null" if label < 0 else b"%d" % label, meta,
                                                 json.dumps(list(problem)).encode() if problem else b"null")

    def keys(self) -> np.ndarray:
        """(N, 2) big-endian uint64: sorting rows by them sorts by the 16-byte keys."""
        return np.frombuffer(self._keys, dtype=">u8").reshape(-1, 2)  # a view: add nothing while it lives

    def nbytes(self) -> int:
        return (len(self._keys) + len(self._sources) + len(self._metas) + 8 * len(self._source_ends)
                + 8 * len(self._meta_ends) + 4 * len(self.labels) + 8 * len(self.sizes))


@dataclass
class PlanHeader:
    """What every task and the merge read: small, whatever the corpus size."""
    fingerprint: str
    parameters: dict
    classes: list[str]
    inputs: int
    shards: int
    parts: int  # the slices were cut for this many parts
    duplicates: int

    def shard_range(self, part: int, num_parts: int) -> range:
        return _part_range(self.shards, part, num_parts)

    def slices_holding(self, shards: range) -> list[int]:
        """The slices (cut for `self.parts`) that hold any of `shards`: a task of a job resumed
        with another --num-parts reads the one or few slices that overlap its shards."""
        return [p for p in range(self.parts)
                if (r := _part_range(self.shards, p, self.parts)) and r.start < shards.stop and shards.start < r.stop]

    def to_bytes(self) -> bytes:
        return json.dumps({"format": PLAN_FORMAT, "format_version": PLAN_FORMAT_VERSION, **asdict(self)},
                          sort_keys=True, indent=1).encode()

    @staticmethod
    def from_bytes(data: bytes, where: str) -> "PlanHeader":
        raw = json.loads(data)
        if raw.pop("format", None) != PLAN_FORMAT or raw.pop("format_version", None) != PLAN_FORMAT_VERSION:
            raise UsageError(f"{where}: not a {PLAN_FORMAT} v{PLAN_FORMAT_VERSION} header")
        return PlanHeader(**raw)


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
    duplicates: list[tuple[int, int, str]]  # (row, row of the first with that content, sha256), listing order

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    def header(self, parts: int) -> PlanHeader:
        return PlanHeader(self.fingerprint, self.parameters, self.classes, len(self.inputs), self.num_shards,
                          parts, len(self.duplicates))

    def slice_bytes(self, part: int, parts: int) -> bytes:
        """One line per item: [shard, key, source, label, meta, problem] (meta spliced as stored)."""
        lines = []
        for shard in _part_range(self.num_shards, part, parts):
            for position in range(self.bounds[shard], self.bounds[shard + 1]):
                lines.append(self.inputs.line(int(self.order[position]), shard, position))
        return gzip.compress(b"".join(lines), compresslevel=1, mtime=0)  # mtime=0: the same bytes each run

    def duplicates_bytes(self) -> bytes:
        lines = [json.dumps({"source": self.inputs.source(row), "duplicate_of": self.inputs.source(first),
                             "sha256": digest}, sort_keys=True).encode() + b"\n"
                 for row, first, digest in self.duplicates]
        return gzip.compress(b"".join(lines), mtime=0)


def write_plan(store, plan: Plan, parts: int, threads: int = 8) -> PlanHeader:
    """Slices and duplicates first, the header last; at most 2 x `threads` slices in memory."""
    def put(part: int) -> None:
        store.put_bytes(slice_name(part), plan.slice_bytes(part, parts))

    for _ in ordered_map(put, range(parts), threads, chunk_size=1, window_per_worker=2, threads=True):
        pass
    store.put_bytes(DUPLICATES_PLAN, plan.duplicates_bytes())
    header = plan.header(parts)
    store.put_bytes(HEADER_NAME, header.to_bytes())
    return header


def read_header(store) -> PlanHeader | None:
    try:
        return PlanHeader.from_bytes(store.get_bytes(HEADER_NAME), store.url(HEADER_NAME))
    except FileNotFoundError:
        return None


def load_slice(store, header: PlanHeader, part: int, num_parts: int) -> dict[int, list[PlanItem]]:
    """The items of the shards part `part` of `num_parts` builds, shard index -> items; reads only
    the slices that hold them (one when `num_parts` is the planner's)."""
    owned = header.shard_range(part, num_parts)
    shards: dict[int, list[PlanItem]] = {i: [] for i in owned}
    for p in header.slices_holding(owned):
        try:
            data = gzip.decompress(store.get_bytes(slice_name(p)))
        except FileNotFoundError:
            raise UsageError(f"{store.url(slice_name(p))}: a slice of a complete plan is missing; delete "
                             f"{store.url(PLAN_DIR)} and rerun to plan again (same inputs, same plan)") from None
        # One parse for the whole slice: lines hold no raw newline (JSON escapes it).
        for shard, *fields in json.loads(b"[" + data.rstrip(b"\n").replace(b"\n", b",") + b"]"):
            if shard in shards:
                shards[shard].append(PlanItem(*fields))
    return shards


def synthetic_inputs(n: int, seed: int = 0, num_classes: int = 1000, mean_bytes: int = 110_000) -> Inputs:
    """`n` made-up inputs (ImageNet-like paths and sizes, nothing on disk): what a benchmark plans
    to measure the planner at scale without listing a corpus."""
    inputs = Inputs(seed)
    for i in range(n):
        label = i % num_classes
        name = f"n{label:08d}/n{label:08d}_{i:09d}.JPEG"
        inputs.add(SourceRecord(f"/data/train/{name}", label, mean_bytes // 2 + (i * 2654435761) % mean_bytes,
                                name=name))
    return inputs


def fingerprint(parameters: dict) -> str:
    return hashlib.sha256(json.dumps(parameters, sort_keys=True).encode()).hexdigest()[:16]


def make_plan(corpus: Corpus, parameters: dict, *, seed: int, shard_bytes: int | None,
              shard_samples: int | None, dedup: bool, threads: int = 8) -> Plan:
    return plan_inputs(Inputs.of(corpus.records, seed), corpus.classes, parameters, shard_bytes=shard_bytes,
                       shard_samples=shard_samples, dedup=dedup, threads=threads)


def plan_inputs(inputs: Inputs, classes: list[str], parameters: dict, *, shard_bytes: int | None,
                shard_samples: int | None, dedup: bool, threads: int = 8,
                read: Callable[[str], bytes] = read_source) -> Plan:
    """`read`: how dedup gets an input's bytes (a benchmark passes synthetic content)."""
    duplicates = deduplicate(inputs, threads, read) if dedup else []
    kept = np.ones(len(inputs), dtype=bool)
    kept[[row for row, _, _ in duplicates]] = False
    rows = np.flatnonzero(kept)
    keys = inputs.keys()[rows]
    # lexsort is stable: equal keys (a name listed twice) keep listing order, as sorted() did.
    order = rows[np.lexsort((keys[:, 1], keys[:, 0]))]
    del keys
    bounds = _cut(np.frombuffer(inputs.sizes, dtype=np.int64), order, shard_bytes, shard_samples)
    return Plan(fingerprint(parameters), parameters, classes, inputs, order, bounds, duplicates)


def _cut(sizes: np.ndarray, order: np.ndarray, shard_bytes: int | None, shard_samples: int | None) -> np.ndarray:
    """Shard boundaries: a shard closes at `shard_samples`, or before the input that would take it
    past `shard_bytes` (a single larger input still gets a shard)."""
    bounds = [0]
    count = total = 0
    for start in range(0, len(order), _CUT_CHUNK):
        for position, size in enumerate((sizes[order[start:start + _CUT_CHUNK]] + SAMPLE_OVERHEAD).tolist(), start):
            if (shard_samples and count >= shard_samples) or (shard_bytes and count and total + size > shard_bytes):
                bounds.append(position)
                count = total = 0
            count += 1
            total += size
    if len(order):
        bounds.append(len(order))
    return np.asarray(bounds, dtype=np.int64)


def _part_range(total: int, part: int, num_parts: int) -> range:
    return range(part * total // num_parts, (part + 1) * total // num_parts)


def _shuffle_key(seed: bytes, name: str) -> bytes:
    # A keyed hash of the name within the corpus, instead of random.shuffle: stable across Python
    # versions, listing order, and where the corpus is mounted.
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), key=seed, digest_size=16).digest()


def deduplicate(inputs: Inputs, threads: int, read: Callable[[str], bytes] = read_source) -> list[tuple[int, int, str]]:
    """Exact duplicates by content sha256, the first in listing order kept: (row, row kept, sha256
    hex) in listing order. Costs 33 bytes per input (digests in one array, grouped by sorting)
    and at most 2 x `threads` reads in flight."""
    def digest(row: int) -> bytes | None:
        if row in inputs.problems:
            return None
        try:
            return hashlib.sha256(read(inputs.source(row))).digest()
        except OSError:
            return None  # unreadable: it will be rejected with its cause when packed

    digests = np.zeros((len(inputs), 32), dtype=np.uint8)
    valid = np.zeros(len(inputs), dtype=bool)
    reads = ordered_map(digest, range(len(inputs)), threads, chunk_size=1, window_per_worker=2, threads=True)
    for row, d in enumerate(reads):
        if d is not None:
            digests[row] = np.frombuffer(d, dtype=np.uint8)
            valid[row] = True
    rows = np.flatnonzero(valid)
    if len(rows) < 2:
        return []
    words = digests[rows].view(">u8")  # (M, 4): sorting by them sorts by the digest
    order = np.lexsort(tuple(words[:, i] for i in range(3, -1, -1)))  # stable: ties in listing order
    ordered = words[order]
    same = np.concatenate(([False], np.all(ordered[1:] == ordered[:-1], axis=1)))
    group_start = np.maximum.accumulate(np.where(same, 0, np.arange(len(order))))
    dup_rows, first_rows = rows[order[same]], rows[order[group_start[same]]]
    listing = np.argsort(dup_rows, kind="stable")
    return [(int(r), int(f), digests[r].tobytes().hex()) for r, f in zip(dup_rows[listing], first_rows[listing])]
