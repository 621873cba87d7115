"""Planning across a job array: every task lists a share of the input, none holds all of it.

A Parquet list (paths or URLs) or a folder is split into one share per task of the job (the count
fixed by the first task, in `spread.json`): runs of row groups, or of top-level entries (class
folders; shards/shares.py). Three steps make the plan, each a set of units made once
(shards/claims.py): every task makes its own unit first, then any unit no live task holds, then
waits for the rest, so a lost or late task delays the plan, never blocks it, and a job array
throttled to fewer running tasks than parts still finishes:

1. labels (labelled sources without a class map to go by): each share's distinct labels, or its
   class folders that hold an input; together they make the class map a whole listing makes.
2. spill: each share's records (stat'ed, keyed, labelled) sorted by shuffle key and written in
   SUB_BUCKETS sections, one gzip member each, with an index of where each section starts.
3. bucket: bucket b's rows, read from every share's spill with one ranged read each, sorted by
   (key, listing order) and cut into shards: slice b of the plan, numbered within the bucket.

The task that finds every bucket made writes the header (the same bytes whoever does) and
deletes the steps' files. The result is the plan one task would make of the whole listing
(plan.py cuts every bucket on its own), so shards are the same whatever --num-parts, and a task
resubmitted with --part reads its slices and rebuilds its shards byte for byte.

Cost per task: a share's records as `Inputs` columns (about 100-250 bytes each: key, size,
source, metadata), then one bucket's (BUCKET_INPUTS on average: 40 bytes of fixed fields plus
its line each); reads: its share of the listing, a bucket's sections of every spill, the spill
indexes (SUB_BUCKETS offsets per share) and one small JSON per unit. Nothing grows with the
listing beyond O(shares + buckets) names and counts, and the class map.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
import zlib
from typing import Callable

import numpy as np

from vitforge.core import PreconditionFailed

from .claims import made_once
from .layout import Work
from .plan import (SUB_BUCKETS, Inputs, PlanHeader, bucket_sub_buckets, buckets_for, cut, fingerprint,
                   read_header)
from .records import SourceError
from .shares import check_source, shareable, share_classes, share_labels, share_records
from .sources import load_class_names

log = logging.getLogger("vitforge.shard")

# One spilled row's fixed fields: its shuffle key, its place in the listing (share << 40 | row in
# the share: listing order, whatever the share count), its size, its line's length.
ROW = np.dtype([("k0", ">u8"), ("k1", ">u8"), ("row", "<u8"), ("size", "<i8"), ("tail", "<u4")])


def spreads(job) -> bool:
    """Whether the job plans across its array: a Parquet list (of paths or URLs) or a folder, split
    over more than one part, neither deduplicated nor extending (those plan in one task: they
    compare every input with every other)."""
    return (job.num_parts > 1 and shareable(job.src, job.image_column) and not (job.dedup or job.extend)
            and job.retry_of is None)


def plan_across_array(job, store, work: Work) -> PlanHeader:
    started = time.monotonic()
    header = read_header(store, work)
    if header is None:
        try:
            header = _plan(job, store, work)
        except FileNotFoundError:  # a late task: the plan was finished and its steps' files deleted
            header = read_header(store, work)
            if header is None:
                raise
        log.info("the shard plan: %d inputs, %d shards in %d buckets, made across %d parts (%.1f s)",
                 header.inputs, header.shards, header.parts, job.num_parts, time.monotonic() - started)
    return header


def _plan(job, store, work: Work) -> PlanHeader:
    shares = _shares(job, store, work)
    label_column = job.label_column if job.labels else None
    given = load_class_names(job.classes_file) if job.classes_file else None
    if label_column and (given is None or job.src.lower().endswith(".parquet")):
        _make_all(job, store, work, "labels", shares, lambda s: json.dumps(share_labels(
            job.src, (s, shares), label_column, job.follow_symlinks, job.root)).encode())
        labels = set()
        for s in range(shares):
            labels.update(json.loads(store.get_bytes(_unit(work, "labels", s))))
        classes, numeric = share_classes(job.src, labels, given)
    else:
        classes, numeric = (given or []), False
    _make_all(job, store, work, "spill", shares, lambda s: _spill(job, store, work, s, shares, classes, numeric))
    inputs = sum(json.loads(store.get_bytes(_unit(work, "spill", s)))["inputs"] for s in range(shares))
    if not inputs:
        raise SourceError(f"{job.src}: no images found under it" if not job.src.lower().endswith(".parquet")
                          else f"{job.src}: manifest has no rows")
    buckets = buckets_for(inputs)
    _make_all(job, store, work, "bucket", buckets, lambda b: _bucket(job, store, work, b, buckets, shares))
    counts = [json.loads(store.get_bytes(_unit(work, "bucket", b))) for b in range(buckets)]
    header = PlanHeader(fingerprint(job.output_parameters()), job.output_parameters(), classes, inputs,
                        sum(c["shards"] for c in counts), buckets, 0,
                        slice_shards=[c["shards"] for c in counts], slice_inputs=[c["inputs"] for c in counts])
    if read_header(store, work) is None:
        store.put_bytes(work.duplicates, gzip.compress(b"", mtime=0))
        store.put_bytes(work.header, header.to_bytes())
        store.delete(store.list(f"{work.plan_dir}/spread/") + [f"{_spread_name(work)}.lock"])
    return header


def _shares(job, store, work: Work) -> int:
    """The share count every task of the job uses: the first task's --num-parts, so a task
    resumed with another count plans the same shares."""
    name = _spread_name(work)
    existing = store.get_versioned(name)
    if existing is not None:
        return json.loads(existing[0])["shares"]
    label_column = job.label_column if job.labels else None
    check_source(job.src, [job.url_column or job.path_column, *filter(None, [label_column]), *(job.meta_columns or ())])
    try:
        store.put_if(name, json.dumps({"shares": job.num_parts}).encode(), None)
    except PreconditionFailed:
        return json.loads(store.get_bytes(name))["shares"]
    return job.num_parts


def _spread_name(work: Work) -> str:
    return f"{work.plan_dir}/spread/spread.json"


def _make_all(job, store, work: Work, step: str, units: int, make: Callable[[int], bytes | None]) -> None:
    """Every unit of `step` made: this task's own first (unit % parts == part), then the others in
    turn from the next, skipping those a live task holds; then the held ones waited for."""
    def unit(i: int):
        name = _unit(work, step, i)

        def made() -> bool:
            data = make(i)
            if data is not None:
                store.put_bytes(name, data)
            return True

        return name, made

    mine = [i for i in range(units) if i % job.num_parts == job.part]
    order = mine + [i for i in range(units) if i % job.num_parts != job.part]
    held = []
    for i in order:
        name, made = unit(i)
        if made_once(store, f"{name}.claim", lambda: _done(store, work, name), made, job.part,
                     f"{step} {i} of the shard plan", job.plan_wait_s, block=False) is None:
            held.append(i)
    for i in held:
        name, made = unit(i)
        made_once(store, f"{name}.claim", lambda: _done(store, work, name), made, job.part,
                  f"{step} {i} of the shard plan", job.plan_wait_s)


def _done(store, work: Work, name: str) -> bool | None:
    """A unit is done when its result exists, or when the whole plan does (its files deleted)."""
    return store.exists(name) or store.exists(work.header) or None


def _unit(work: Work, step: str, i: int) -> str:
    return f"{work.plan_dir}/spread/{step}-{i:05d}.json"


def _spill(job, store, work: Work, share: int, shares: int, classes: list[str], numeric: bool) -> bytes:
    """Writes the share's spill; returns its index (the unit's result): each section's start."""
    label_column = job.label_column if job.labels else None
    records = share_records(job.src, (share, shares), classes=classes, numeric=numeric,
                            path_column=job.url_column or job.path_column, label_column=label_column, root=job.root,
                            url_list=bool(job.url_column), meta_columns=job.meta_columns,
                            follow_symlinks=job.follow_symlinks)
    inputs = Inputs.of(records, job.seed)
    keys = inputs.keys()
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    fixed = np.zeros(len(order), ROW)
    fixed["k0"], fixed["k1"] = keys[order, 0], keys[order, 1]
    fixed["row"] = (share << 40) + order
    fixed["size"] = np.frombuffer(inputs.sizes, dtype=np.int64)[order]
    sub = (fixed["k0"] >> np.uint64(52)).astype(np.int64)
    starts = np.searchsorted(sub, np.arange(SUB_BUCKETS + 1))
    body, offsets = bytearray(), [0]
    for s in range(SUB_BUCKETS):
        if starts[s] < starts[s + 1]:
            tails = [inputs.tail(int(i)) for i in order[starts[s]:starts[s + 1]]]
            section = fixed[starts[s]:starts[s + 1]].copy()
            section["tail"] = [len(t) for t in tails]
            body += gzip.compress(section.tobytes() + b"".join(tails), compresslevel=1, mtime=0)
        offsets.append(len(body))
    store.put_bytes(_spill_name(work, share), bytes(body))
    return json.dumps({"inputs": len(order), "offsets": offsets, "rows": np.diff(starts).tolist()}).encode()


def _spill_name(work: Work, share: int) -> str:
    return f"{work.plan_dir}/spread/spill-{share:05d}.bin"


def _bucket(job, store, work: Work, bucket: int, buckets: int, shares: int) -> bytes:
    """Writes bucket `bucket`'s plan slice; returns its counts (the unit's result)."""
    subs = bucket_sub_buckets(bucket, buckets)
    fixed, tails = [], []
    for share in range(shares):
        index = json.loads(store.get_bytes(_unit(work, "spill", share)))
        start, end = index["offsets"][subs.start], index["offsets"][subs.stop]
        data = store.get_range(_spill_name(work, share), start, end) if end > start else b""
        body = _inflated(data)
        at = 0
        for rows in index["rows"][subs.start:subs.stop]:
            if rows:
                section = np.frombuffer(body, ROW, rows, at)
                at += rows * ROW.itemsize
                size = int(section["tail"].sum())
                fixed.append(section)
                tails.append(body[at:at + size])
                at += size
    rows = np.concatenate(fixed) if fixed else np.zeros(0, ROW)
    blob = b"".join(tails)
    ends = np.cumsum(rows["tail"], dtype=np.int64)
    order = np.lexsort((rows["row"], rows["k1"], rows["k0"]))
    bounds = cut(rows["size"].astype(np.int64), order, job.shard_bytes, job.shard_samples)
    lines = bytearray()
    for shard in range(len(bounds) - 1):
        for position in range(bounds[shard], bounds[shard + 1]):
            i = order[position]
            lines += b'[%d,"%09d",' % (shard, position) + blob[ends[i] - rows["tail"][i]:ends[i]]
    store.put_bytes(work.slice(bucket), gzip.compress(bytes(lines), compresslevel=1, mtime=0))
    return json.dumps({"shards": len(bounds) - 1, "inputs": len(rows)}).encode()


def _inflated(data: bytes) -> bytes:
    """The sections of a spill's byte range, decompressed: concatenated gzip members."""
    out, rest = [], data
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out.append(d.decompress(rest))
        rest = d.unused_data
    return b"".join(out)
