"""Turn a listed corpus into a shard plan: dedup, seeded global shuffle, cut into shards.

The plan depends only on the listing, the seed and the size policy, never on worker count or
timing, so every shard can be built independently: by any worker count, by any part of a job
array, or again after a crash, and always to the same bytes. Shard boundaries come from source
sizes (known before decoding), which is why a shard's final size only approximates the target
when images are re-encoded or resized.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from .sources import Corpus, SourceRecord, read_source

# Per-sample tar overhead beyond the image: three headers, the .cls and .json members, padding.
SAMPLE_OVERHEAD = 4 * 512


@dataclass
class PlanItem:
    key: str
    source: str
    label: int | None
    meta: dict = field(default_factory=dict)
    problem: list | None = None


@dataclass
class Plan:
    fingerprint: str
    parameters: dict
    classes: list[str]
    shards: list[list[PlanItem]]
    duplicates: list[dict]
    inputs: int

    def shard_range(self, part: int, num_parts: int) -> range:
        total = len(self.shards)
        return range(part * total // num_parts, (part + 1) * total // num_parts)

    def to_bytes(self) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return gzip.compress(body, mtime=0)  # mtime=0 keeps the file byte-identical across runs

    @staticmethod
    def from_bytes(data: bytes) -> "Plan":
        raw = json.loads(gzip.decompress(data))
        raw["shards"] = [[PlanItem(**item) for item in shard] for shard in raw["shards"]]
        return Plan(**raw)


def fingerprint(parameters: dict) -> str:
    return hashlib.sha256(json.dumps(parameters, sort_keys=True).encode()).hexdigest()[:16]


def make_plan(corpus: Corpus, parameters: dict, *, seed: int, shard_bytes: int | None,
              shard_samples: int | None, dedup: bool, threads: int = 8) -> Plan:
    records = corpus.records
    duplicates: list[dict] = []
    if dedup:
        records, duplicates = _deduplicate(records, threads)
    order = sorted(range(len(records)), key=lambda i: _shuffle_key(seed, records[i].name))
    shards: list[list[PlanItem]] = [[]]
    shard_size = 0
    for position, i in enumerate(order):
        record = records[i]
        size = record.size + SAMPLE_OVERHEAD
        current = shards[-1]
        full = (shard_samples and len(current) >= shard_samples) or (
            shard_bytes and current and shard_size + size > shard_bytes)
        if full:
            shards.append([])
            shard_size = 0
        shards[-1].append(PlanItem(f"{position:09d}", record.source, record.label, record.meta,
                                   list(record.problem) if record.problem else None))
        shard_size += size
    if not shards[-1]:
        shards.pop()
    return Plan(fingerprint(parameters), parameters, corpus.classes, shards, duplicates, len(corpus.records))


def _shuffle_key(seed: int, name: str) -> bytes:
    # A keyed hash of the name within the corpus, instead of random.shuffle: stable across Python
    # versions, listing order, and where the corpus is mounted.
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), key=str(seed).encode(), digest_size=16).digest()


def _deduplicate(records: list[SourceRecord], threads: int) -> tuple[list[SourceRecord], list[dict]]:
    """Exact duplicates by content sha256; the first in listing order is kept."""
    def digest(record: SourceRecord) -> str | None:
        if record.problem:
            return None
        try:
            return hashlib.sha256(read_source(record.source)).hexdigest()
        except OSError:
            return None  # unreadable: it will be rejected with its cause when packed

    with ThreadPoolExecutor(threads) as pool:
        digests = list(pool.map(digest, records))
    first: dict[str, str] = {}
    kept, duplicates = [], []
    for record, d in zip(records, digests):
        if d is not None and d in first:
            duplicates.append({"source": record.source, "duplicate_of": first[d], "sha256": d})
            continue
        if d is not None:
            first[d] = record.source
        kept.append(record)
    return kept, duplicates
