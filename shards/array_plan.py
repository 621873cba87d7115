"""Planning across a job array: every task lists a share of the input, none holds all of it.

A Parquet list (paths or URLs) or a folder is always planned this way, split into one share per
part of the job (the count, and the plan's fingerprint, fixed by the first task in `spread.json`):
rows of the list, or runs of top-level entries (class folders; shards/shares.py). Three steps
make the plan, each a set of units made once (shards/claims.py): every task makes its own unit
first, then any unit no live task holds, then waits for the rest, so a lost or late task delays
the plan, never blocks it, and a job array throttled to fewer running tasks than parts finishes:

1. labels (labelled sources without a class map to go by): each share's distinct labels, or its
   class folders that hold an input; together they make the class map a whole listing makes.
2. spill: each share's records (stat'ed, keyed, labelled), in runs of at most RUN_INPUTS, each run
   sorted by shuffle key and written in SUB_BUCKETS sections (one gzip member each) to a file
   named afresh by every writer, with an index (the unit's result) naming it and each section.
3. bucket: the sorted inputs split into `buckets_for(N)` buckets of about BUCKET_INPUTS by the
   keys' top bits (runs of sub-buckets); bucket b's rows, read from every run with one ranged read
   each, sorted by (key, listing order) and cut into shards on their own (one short shard per
   bucket): slice b of the plan, numbered within the bucket.

The task that finds every bucket made writes the header (the same bytes whoever does); every task
that finds the header deletes what is left of the steps' files. The plan depends on the listing,
the seed and the size policy only, so shards are the same whatever --num-parts, whichever task
makes which unit, and a task resubmitted with --part reads its slices and rebuilds its shards
byte for byte. Below BUCKET_INPUTS inputs there is one bucket: the plan one task makes of a
manifest (plan.py).

Cost per task: a run of its share's records as `Inputs` columns (RUN_INPUTS at most, about
100-250 bytes each: key, size, source, metadata), then one bucket's rows (BUCKET_INPUTS on
average, 40 bytes of fixed fields plus its line each; rows of equal keys, such as a URL listed
many times, share a bucket); reads: its share of the listing (a list's row groups overlapping its
rows, a folder's names at the top level), a bucket's sections of every run, the spill indexes
(8 bytes per sub-bucket per run, kept) and one small JSON per unit. Nothing grows with the
listing beyond O(shares + buckets) names and counts, and the class map.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable

import numpy as np

from vitforge.core import PreconditionFailed, UsageError

from .claims import made_once
from .layout import Work
from .manifest import command_line
from .plan import SUB_BUCKETS, Inputs, bucket_sub_buckets, buckets_for, cut, fingerprint
from .plan_slices import PlanHeader, read_header
from .records import SourceError, display_path
from .shares import check_source, share_classes, share_labels, share_records, shareable
from .sources import load_class_names

log = logging.getLogger("vitforge.shard")

RUN_INPUTS = 1 << 21  # a spill's runs: the most records a task holds at once while spilling
# One spilled row's fixed fields: its shuffle key, its place in the listing (share << 40 | row in
# the share: listing order, whatever the share count), its size, its line's length.
ROW = np.dtype([("k0", ">u8"), ("k1", ">u8"), ("row", "<u8"), ("size", "<i8"), ("tail", "<u4")])


def spreads(job) -> bool:
    """Whether the job is planned in shares: a Parquet list (of paths or URLs) or a folder, neither
    deduplicated nor extending (those plan in one task: they compare every input with every
    other). Decided by the parameters alone, so every task of a destination plans alike."""
    return shareable(job.src, job.image_column) and not (job.dedup or job.extend) and job.retry_of is None


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
        log.info(
            "the shard plan: %d inputs, %d shards in %d buckets, made in %d shares (%.1f s)",
            header.inputs,
            header.shards,
            header.parts,
            _shares_of(store, work, job.num_parts),
            time.monotonic() - started,
        )
    _tidy(store, work)
    return header


def _plan(job, store, work: Work) -> PlanHeader:
    shares = _shares(job, store, work)
    label_column = job.label_column if job.labels else None
    given = load_class_names(job.classes_file) if job.classes_file else None
    if label_column and (given is None or job.src.lower().endswith(".parquet")):
        _make_all(
            job,
            store,
            work,
            "labels",
            shares,
            lambda s: json.dumps(
                share_labels(job.src, (s, shares), label_column, job.follow_symlinks, job.root)
            ).encode(),
        )
        labels = set()
        for s in range(shares):
            labels.update(json.loads(store.get_bytes(_unit(work, "labels", s))))
        classes, numeric = share_classes(job.src, labels, given)
    else:
        classes, numeric = (given or []), False
    _make_all(job, store, work, "spill", shares, lambda s: _spill(job, store, work, s, shares, classes, numeric))
    index = functools.cache(lambda s: _read_index(store, work, s))
    inputs = sum(index(s)["inputs"] for s in range(shares))
    if not inputs:
        raise SourceError(_nothing_found(job))
    buckets = buckets_for(inputs)
    _make_all(job, store, work, "bucket", buckets, lambda b: _bucket(job, store, work, b, buckets, shares, index))
    counts = [json.loads(store.get_bytes(_unit(work, "bucket", b))) for b in range(buckets)]
    header = PlanHeader(
        fingerprint(job.output_parameters()),
        job.output_parameters(),
        classes,
        inputs,
        sum(c["shards"] for c in counts),
        buckets,
        0,
        slice_shards=[c["shards"] for c in counts],
        slice_inputs=[c["inputs"] for c in counts],
    )
    if read_header(store, work) is None:
        store.put_bytes(work.duplicates, gzip.compress(b"", mtime=0))
        store.put_bytes(work.header, header.to_bytes())
    return header


def _nothing_found(job) -> str:
    if job.src.lower().endswith(".parquet"):
        return f"{job.src}: manifest has no rows"
    if job.labels:
        return f"{display_path(job.src)}: no images found in class folders (expected SRC/CLASS/IMAGE)"
    return f"{display_path(job.src)}: no images found under it"


def _shares(job, store, work: Work) -> int:
    """The share count every task uses: the first task's --num-parts, so a task resumed with
    another count plans the same shares. A plan under way with other parameters is refused."""
    name, parameters = _spread_name(work), job.output_parameters()
    existing = store.get_versioned(name)
    if existing is None:
        check_source(
            job.src,
            [job.url_column or job.path_column, *([job.label_column] if job.labels else []), *(job.meta_columns or ())],
        )
        spread = {"shares": job.num_parts, "fingerprint": fingerprint(parameters), "command": command_line(parameters)}
        try:
            store.put_if(name, json.dumps(spread).encode(), None)
            return job.num_parts
        except PreconditionFailed:
            existing = store.get_versioned(name)
    spread = json.loads(existing[0])
    if spread["fingerprint"] != fingerprint(parameters):
        raise UsageError(
            f"{job.dest}: a shard plan with other parameters is being made there, by "
            f"`{spread['command']}`: run that command to finish it, or delete "
            f"{store.url(work.plan_dir)}/spread/ (once none of its tasks runs) to plan anew"
        )
    return spread["shares"]


def _shares_of(store, work: Work, default: int) -> int:
    spread = store.get_versioned(_spread_name(work))
    return json.loads(spread[0])["shares"] if spread else default


def _tidy(store, work: Work) -> None:
    """The plan exists: what its steps left (a finisher killed before it tidied, a task that
    finished a unit after the tidy) goes, claims' lock files included."""
    left = store.list(f"{work.plan_dir}/spread/")
    if left:
        store.delete(left + [f"{n}.lock" for n in left if n.endswith((".claim", "spread.json"))])


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
        if (
            made_once(
                store,
                f"{name}.claim",
                lambda: _done(store, work, name),  # noqa: B023 - made_once calls it before the loop goes on
                made,
                job.part,
                f"{step} {i} of the shard plan",
                job.plan_wait_s,
                block=False,
            )
            is None
        ):
            held.append(i)
    for i in held:
        name, made = unit(i)
        made_once(
            store,
            f"{name}.claim",
            lambda: _done(store, work, name),  # noqa: B023 - made_once calls it before the loop goes on
            made,
            job.part,
            f"{step} {i} of the shard plan",
            job.plan_wait_s,
        )


def _done(store, work: Work, name: str) -> bool | None:
    """A unit is done when its result exists, or when the whole plan does (its files deleted)."""
    return store.exists(name) or store.exists(work.header) or None


def _unit(work: Work, step: str, i: int) -> str:
    return f"{work.plan_dir}/spread/{step}-{i:05d}.json"


def _spill(job, store, work: Work, share: int, shares: int, classes: list[str], numeric: bool) -> bytes:
    """Writes the share's runs; returns its index (the unit's result): each run's file and sections."""
    label_column = job.label_column if job.labels else None
    records = iter(
        share_records(
            job.src,
            (share, shares),
            classes=classes,
            numeric=numeric,
            path_column=job.url_column or job.path_column,
            label_column=label_column,
            root=job.root,
            url_list=bool(job.url_column),
            meta_columns=job.meta_columns,
            follow_symlinks=job.follow_symlinks,
        )
    )
    token = secrets.token_hex(6)  # a writer's own files: an index never names another writer's run
    runs: list[dict] = []
    total = 0
    while True:
        inputs = Inputs.of(itertools.islice(records, RUN_INPUTS), job.seed)
        if not len(inputs):
            break
        name = f"{work.plan_dir}/spread/spill-{share:05d}-{len(runs):04d}-{token}.bin"
        runs.append({"file": name, **_write_run(store, name, inputs, (share << 40) + total)})
        total += len(inputs)
        if len(inputs) < RUN_INPUTS:
            break
    return json.dumps({"inputs": total, "runs": runs}).encode()


def _write_run(store, name: str, inputs: Inputs, first_row: int) -> dict:
    """One run, sorted by key, in SUB_BUCKETS sections: [fixed rows][their lines], gzip'd each."""
    keys = inputs.keys()
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    fixed = np.zeros(len(order), ROW)
    fixed["k0"], fixed["k1"] = keys[order, 0], keys[order, 1]
    fixed["row"] = first_row + order
    fixed["size"] = np.frombuffer(inputs.sizes, dtype=np.int64)[order]
    starts = np.searchsorted((fixed["k0"] >> np.uint64(52)).astype(np.int64), np.arange(SUB_BUCKETS + 1))
    body, offsets = bytearray(), [0]
    for s in range(SUB_BUCKETS):
        if starts[s] < starts[s + 1]:
            tails = [inputs.tail(i) for i in order[starts[s] : starts[s + 1]].tolist()]
            section = fixed[starts[s] : starts[s + 1]].copy()
            section["tail"] = [len(t) for t in tails]
            body += gzip.compress(section.tobytes() + b"".join(tails), compresslevel=1, mtime=0)
        offsets.append(len(body))
    store.put_bytes(name, bytes(body))
    return {"offsets": offsets, "rows": np.diff(starts).tolist()}


def _read_index(store, work: Work, share: int) -> dict:
    """A share's spill index, its offsets as arrays (8 bytes per sub-bucket per run)."""
    index = json.loads(store.get_bytes(_unit(work, "spill", share)))
    for run in index["runs"]:
        run["offsets"], run["rows"] = np.asarray(run["offsets"], np.int64), np.asarray(run["rows"], np.int64)
    return index


def _bucket(job, store, work: Work, bucket: int, buckets: int, shares: int, index: Callable[[int], dict]) -> bytes:
    """Writes bucket `bucket`'s plan slice; returns its counts (the unit's result)."""
    subs = bucket_sub_buckets(bucket, buckets)
    fixed, tails = [], []
    for share in range(shares):
        for run in index(share)["runs"]:
            offsets, first = run["offsets"], int(run["offsets"][subs.start])
            if offsets[subs.stop] == first:
                continue
            data = store.get_range(run["file"], first, int(offsets[subs.stop]))
            for sub in subs:
                count = int(run["rows"][sub])
                if count:
                    body = gzip.decompress(data[offsets[sub] - first : offsets[sub + 1] - first])
                    fixed.append(np.frombuffer(body, ROW, count))
                    tails.append(body[count * ROW.itemsize :])
    rows = np.concatenate(fixed) if fixed else np.zeros(0, ROW)
    blob = b"".join(tails)
    del fixed, tails
    lengths = rows["tail"].tolist()
    ends = np.cumsum(rows["tail"], dtype=np.int64).tolist()
    order = np.lexsort((rows["row"], rows["k1"], rows["k0"]))
    bounds = cut(rows["size"].astype(np.int64), order, job.shard_bytes, job.shard_samples).tolist()
    order = order.tolist()
    lines = bytearray()
    for shard in range(len(bounds) - 1):
        for position in range(bounds[shard], bounds[shard + 1]):
            i = order[position]
            lines += b'[%d,"%09d",' % (shard, position) + blob[ends[i] - lengths[i] : ends[i]]
    store.put_bytes(work.slice(bucket), gzip.compress(bytes(lines), compresslevel=1, mtime=0))
    return json.dumps({"shards": len(bounds) - 1, "inputs": len(rows)}).encode()
