"""The shard plan (shards/plan.py): shards within their limits whatever the listing order, plan
slices that reproduce the one-file plan for any part count, and dedup that keeps the first of each
image with at most twice its threads' reads in flight."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import threading
import time
from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitforge.core import open_store
from vitforge.shards.plan import SAMPLE_OVERHEAD, Inputs, deduplicate, make_plan, plan_inputs, write_plan
from vitforge.shards.plan_slices import load_slice
from vitforge.shards.sources import Corpus, SourceRecord


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=200), st.integers(0, 3),
       st.one_of(st.none(), st.integers(1, 20)), st.one_of(st.none(), st.integers(3000, 40000)))
def test_plan_respects_limits_and_ignores_listing_order(sizes, seed, per_shard, shard_bytes):
    if per_shard is None and shard_bytes is None:
        per_shard = 7
    records = [SourceRecord(f"/data/c/{i}.jpg", i % 3, size) for i, size in enumerate(sizes)]
    plan = make_plan(Corpus(records, ["a", "b", "c"]), {}, seed=seed, shard_bytes=shard_bytes,
                     shard_samples=per_shard, dedup=False)
    shuffled = records[:]
    random.Random(seed).shuffle(shuffled)
    again = make_plan(Corpus(shuffled, ["a", "b", "c"]), {}, seed=seed, shard_bytes=shard_bytes,
                      shard_samples=per_shard, dedup=False)
    assert plan.slice_bytes(0, 1) == again.slice_bytes(0, 1)
    # One row per item: [shard, key, source, label, meta, problem].
    rows = [json.loads(line) for line in gzip.decompress(plan.slice_bytes(0, 1)).splitlines()]
    shards = [[row for row in rows if row[0] == i] for i in range(plan.num_shards)]
    assert sorted(row[2] for row in rows) == sorted(r.source for r in records)
    size_of = {r.source: r.size + SAMPLE_OVERHEAD for r in records}
    for shard in shards:
        assert shard
        if per_shard:
            assert len(shard) <= per_shard
        if shard_bytes and len(shard) > 1:
            assert sum(size_of[row[2]] for row in shard) <= shard_bytes
    keys = [row[1] for row in rows]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def reference_items(records: list[SourceRecord], seed: int, shard_samples: int | None,
                    shard_bytes: int | None) -> list[list[dict]]:
    """The plan as the one-file planner made it (before slices): sorted() by the keyed hash of the
    name, greedy cut; an independent oracle for the columns' lexsort and chunked cut."""
    def key(record):
        return hashlib.blake2b(record.name.encode("utf-8", "surrogateescape"), key=str(seed).encode(),
                               digest_size=16).digest()

    shards, size = [[]], 0
    for position, record in enumerate(sorted(records, key=key)):
        item_size = record.size + SAMPLE_OVERHEAD
        if (shard_samples and len(shards[-1]) >= shard_samples) or (
                shard_bytes and shards[-1] and size + item_size > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append({"key": f"{position:09d}", "source": record.source, "label": record.label,
                           "meta": record.meta, "problem": list(record.problem) if record.problem else None})
        size += item_size
    return shards


def odd_records(n: int) -> list[SourceRecord]:
    """Labels and none, metadata, problems, a name listed twice, a non-UTF-8 (surrogate-escaped) path."""
    records = []
    for i in range(n):
        name = f"c{i % 3}/img{i:04d}.jpg" if i != 7 else "c0/\udcff-latin1.jpg"
        records.append(SourceRecord(f"/data/{name}", None if i % 11 == 0 else i % 3, 100 + (i * 7919) % 4000,
                                    meta={"caption": f"#{i} \u00e9"} if i % 4 == 0 else {},
                                    problem=("missing_path", f"row {i}") if i % 13 == 0 else None, name=name))
    records.append(SourceRecord("/data/again.jpg", 1, 500, name="c1/img0001.jpg"))  # same name: ties keep listing order
    return records


@pytest.mark.parametrize("shard_samples, shard_bytes", [(7, None), (None, 9000), (5, 6000)])
def test_slices_reproduce_the_one_file_plan_for_any_part_count(tmp_path, shard_samples, shard_bytes):
    records = odd_records(200)
    plan = plan_inputs(Inputs.of(records, seed=3), ["a", "b", "c"], {}, shard_bytes=shard_bytes,
                       shard_samples=shard_samples, dedup=False)
    store = open_store(str(tmp_path))
    header = write_plan(store, plan, parts=3)
    expected = reference_items(records, 3, shard_samples, shard_bytes)
    assert header.shards == len(expected) > 6 and header.inputs == 201
    for num_parts in (3, 1, 2, 5, header.shards + 2):  # the planner's count, and a job resumed with others
        got = []
        for part in range(num_parts):
            shards = load_slice(store, header, part, num_parts)
            assert list(shards) == list(header.shard_range(part, num_parts))
            got += [[asdict(item) for item in items] for items in shards.values()]
        assert got == expected, num_parts


def test_dedup_keeps_the_first_and_holds_at_most_twice_the_threads_in_flight():
    contents = [f"image {i % 37 if i % 5 == 0 else 1000 + i}".encode() for i in range(300)]
    records = [SourceRecord(str(i), 0, 10, name=str(i), problem=("empty", "") if i == 35 else None)
               for i in range(300)]
    inputs = Inputs.of(records, seed=0)
    started, release = [], threading.Event()

    def read(source: str) -> bytes:  # row 0 holds the ordered results back until released
        started.append(int(source))
        if source == "0":
            release.wait(30)
        if source == "299":
            raise FileNotFoundError(source)
        return contents[int(source)]

    threads = 4
    worker = threading.Thread(target=lambda: found.extend(deduplicate(inputs, threads, read)))
    found: list = []
    worker.start()
    time.sleep(0.5)
    in_flight = len(started)
    release.set()
    worker.join(30)
    assert in_flight <= 2 * threads
    first: dict[bytes, int] = {}
    expected = []
    for i, data in enumerate(contents[:299]):
        if i == 35:
            continue
        if data in first:
            expected.append((i, first[data], hashlib.sha256(data).hexdigest()))
        first.setdefault(data, i)
    assert found == expected and len(expected) > 10
