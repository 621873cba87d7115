"""scale_bench's steps of planning a URL list across a job array: a LAION-like Parquet list of
scale x 400M rows planned by 64 tasks; one task's share (list and spill its rows), one bucket
(read from every task's spill, sorted, cut, written as a plan slice), and what they add up to for
the whole array at the issue's scale."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from benchmarks.common import rss_mb

URL_LIST_ROWS = 400_000_000  # the URL list, planned across an array of TASKS
TASKS = 64


def _url_list_job(work: Path, scale: float):
    """A LAION-like Parquet URL list of scale x 400M rows (url, caption; one row group per task),
    written by `prepare` (in a process of its own, so a step's peak is its own)."""
    from vitforge.shards import ShardJob

    n = max(TASKS, round(URL_LIST_ROWS * scale))
    folder = work / f"url-list-{scale:g}"
    return ShardJob(src=str(folder / "urls.parquet"), dest=str(folder / "shards"), shard_samples=10_000,
                    shard_bytes=None, url_column="url", caption_column="caption", labels=False, num_parts=TASKS), n


def prepare(step: str, work: Path, scale: float) -> None:
    """What a step reads, made before it runs: the URL list; for `bucket`, every task's spill."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vitforge.core import open_store
    from vitforge.shards.array_plan import _spill, _unit
    from vitforge.shards.layout import FIRST

    job, n = _url_list_job(work, scale)
    listing = Path(job.src)
    listing.parent.mkdir(parents=True, exist_ok=True)
    if not listing.exists():
        with pq.ParquetWriter(listing, pa.schema([("url", pa.string()), ("caption", pa.string())])) as writer:
            for start in range(0, n, n // TASKS):
                ids = range(start, min(n, start + n // TASKS))
                writer.write_table(pa.table({
                    "url": [f"https://img{i % 997}.example.com/photos/{i:010d}/{i * 2654435761 % 2**32:08x}.jpg"
                            for i in ids],
                    "caption": [f"a photo of thing {i % 5003} in place {i % 127}" for i in ids]}),
                    row_group_size=n // TASKS)
    store = open_store(job.dest)
    for share in range(TASKS if step == "bucket" else 0):
        if not store.exists(_unit(FIRST, "spill", share)):
            store.put_bytes(_unit(FIRST, "spill", share), _spill(job, store, FIRST, share, TASKS, [], False))


def step_share(work: Path, scale: float) -> dict:
    """Planning across a 64-task array, a task's own work: list its share of the URL list and spill
    it (one row group here: 1/64 of the rows)."""
    from vitforge.core import open_store
    from vitforge.shards.array_plan import _spill
    from vitforge.shards.layout import FIRST

    __import__("pyarrow.parquet")  # its import is start-up, not the share's cost

    job, n = _url_list_job(work, scale)
    store = open_store(job.dest)
    before, start = rss_mb(), time.perf_counter()
    index = json.loads(_spill(job, store, FIRST, 0, TASKS, [], False))
    return {"seconds": time.perf_counter() - start, "peak_mb": rss_mb() - before, "rows": index["inputs"]}


def step_bucket(work: Path, scale: float) -> dict:
    """Planning across the array, the second half: one bucket (BUCKET_INPUTS rows on average, so a
    bucket costs the same at any scale past BUCKET_INPUTS) read from all 64 spills, sorted, cut and
    written as a plan slice. The spills are made first, by `prepare`."""
    from vitforge.core import open_store
    from vitforge.shards.array_plan import _bucket, _read_index
    from vitforge.shards.layout import FIRST
    from vitforge.shards.plan import buckets_for

    job, n = _url_list_job(work, scale)
    store = open_store(job.dest)
    buckets = buckets_for(n)
    before, start = rss_mb(), time.perf_counter()
    indexes = [_read_index(store, FIRST, share) for share in range(TASKS)]  # what a task keeps between buckets
    counts = json.loads(_bucket(job, store, FIRST, 0, buckets, TASKS, indexes.__getitem__))
    return {"seconds": time.perf_counter() - start, "peak_mb": rss_mb() - before, "rows": counts["inputs"],
            "buckets": buckets}


def array_plan_figures(report: dict) -> dict:
    """The plan's wall time and per-task peak across the array at the paper's scale, against the
    issue's targets (10 minutes, 4 GB): a task's share (6.25M rows) scaled linearly from the
    largest share measured (its per-row cost, start-up included: an overestimate; its memory, that
    of one run of RUN_INPUTS rows, which is all a task holds of its share at once), then the
    buckets it sorts and cuts, the slowest and largest full-size bucket measured (a bucket holds
    BUCKET_INPUTS rows on average at any scale past that, so its cost is measured, not
    extrapolated), and the barriers' polling (5 s for each of 3 steps)."""
    from vitforge.shards.array_plan import RUN_INPUTS
    from vitforge.shards.plan import BUCKET_INPUTS, buckets_for

    shares = report["share"]["runs"]
    largest = shares[max(shares, key=float)]
    share_rows = URL_LIST_ROWS // TASKS
    share_s = largest["seconds"] * share_rows / largest["rows"]
    share_mb = largest["peak_mb"] * min(share_rows, RUN_INPUTS) / largest["rows"]  # a task holds one run
    runs = list(report["bucket"]["runs"].values())
    full = [r for r in runs if r["rows"] >= 0.9 * BUCKET_INPUTS]
    # Below scale 0.01 no bucket is full size: the largest measured, scaled linearly (a smoke run's).
    measured = full or [max(runs, key=lambda r: r["rows"])]
    bucket_s = max(r["seconds"] * BUCKET_INPUTS / r["rows"] for r in measured)
    bucket_mb = max(r["peak_mb"] * (1 if full else BUCKET_INPUTS / r["rows"]) for r in measured)
    buckets = buckets_for(URL_LIST_ROWS)
    per_task = math.ceil(buckets / TASKS)
    wall = share_s + per_task * bucket_s + 3 * 5
    peak = max(share_mb, bucket_mb)
    print(f"array plan: {URL_LIST_ROWS:,} rows over {TASKS} tasks: a share of {share_rows:,} rows {share_s:,.0f} s "
          f"({largest['rows']:,} measured, scaled linearly), then {per_task} of {buckets} buckets at {bucket_s:,.1f} s "
          f"each ({f'the slowest of {len(full)} full-size buckets measured' if full else 'scaled from a smaller one'}),"
          f" +15 s of polling = {wall:,.0f} s, target 600 s: {wall / 600:.2f}x (goal <= 1x)")
    print(f"array plan: per-task peak max(share {share_mb:,.0f} MB, bucket {bucket_mb:,.0f} MB) = {peak:,.0f} MB, "
          f"target 4,000 MB: {peak / 4000:.2f}x (goal <= 1x)")
    return {"wall_s": wall, "peak_mb": peak, "share_s": share_s, "share_mb": share_mb, "bucket_s": bucket_s,
            "bucket_mb": bucket_mb, "buckets_per_task": per_task}
