"""`vitforge shard --retry-failed DEST`: download a URL-list dataset's retryable failures again.

A retry is an extension (see extend.py) whose inputs are the rows of every version's plan whose
reject is marked `retryable` (timeouts, connection errors, 408, 429, 5xx, robots.txt unavailable),
with their keys, labels and columns as planned: a row that now downloads becomes a sample under
the key it always had, in new shards; the others stay rejects. The dataset's totals keep each row
once (inputs do not grow; rejected shrinks by what came through). Rows are downloaded with the
settings that decide what a success holds (user agent, opt-outs, allowed networks, body and
redirect limits, columns) that the URL-list versions were listed with (they must agree); only
timing (concurrency, timeouts, retries) comes from the command line. Run it again to retry what
still fails; a late task of a job array whose retry is merged finds its work done.
"""

from __future__ import annotations

import dataclasses
import gzip

from vitforge.core import UsageError, scheduler_env

from .download import DownloadOptions
from .extend import Extension, version_plans
from .images import ImageOptions
from .layout import REJECTS_NAME
from .manifest import history_of, jsonl_rows, read_manifest, version_of
from .plan import fingerprint
from .plan_slices import PlanHeader, plan_lines
from .url_guard import parse_networks

# Settings of a URL list that a retry takes from the version that listed the rows.
OUTPUT_DOWNLOAD = ("max_bytes", "max_redirects", "user_agent", "ignore_opt_outs", "allow_networks")


def retry_settings(store, dest: str, timing: DownloadOptions) -> dict:
    """ShardJob's fields for `vitforge shard --retry-failed DEST`: the latest version's retryable
    rejects, with the settings of the URL list they were listed from. A task of a job array whose
    retry is merged already (it started late) gets that retry's fields, so it finds its work done
    instead of starting another."""
    base = read_manifest(store)
    p = _listing_parameters(store, base, dest)
    last = history_of(base)[-1]
    job = _array_job()
    retry_of = last["version"] - 1 if job is not None and last.get("array_job") == job else version_of(base)
    return {
        "src": p["src"],
        "prefix": p["prefix"],
        "seed": p["seed"],
        "shard_bytes": None,
        "image": ImageOptions(**p["image"]),
        "labels": p["labels"],
        "url_column": p["url_column"],
        "caption_column": p["caption_column"],
        "meta_columns": None if p["meta_columns"] is None else tuple(p["meta_columns"]),
        "download": download_options(p, timing),
        "extend": True,
        "retry_of": retry_of,
    }


def _array_job() -> str | None:
    """This task's SLURM array job ("slurm:1234"), or None outside an array."""
    env = scheduler_env()
    return env.job.rsplit("_", 1)[0] if env.job and env.array_index is not None else None


def _listing_parameters(store, base: dict, dest: str) -> dict:
    """The output parameters of the dataset's URL-list versions, which must agree on what a download
    keeps (one downloader fetches every row of a retry)."""
    listed = []
    for entry, _, header in version_plans(store, base):
        if header is not None and header.parameters.get("url_column") and "retry_of" not in header.parameters:
            listed.append((entry["version"], header.parameters))
    if not listed:
        raise UsageError(
            f"{dest}: --retry-failed downloads a URL list's failures again; no version of this dataset "
            "was sharded from a URL list (--url-col)"
        )
    kept = ("url_column", "caption_column", "meta_columns", "download")
    for version, parameters in listed[1:]:
        differ = [k for k in kept if parameters.get(k) != listed[0][1].get(k)]
        if differ:
            raise UsageError(
                f"{dest}: versions {listed[0][0]} and {version} were listed with other "
                f"{', '.join(differ)}; --retry-failed fetches every failed row with one set of them"
            )
    return listed[-1][1]


def download_options(parameters: dict, timing: DownloadOptions) -> DownloadOptions:
    """`timing`'s concurrency, timeouts and retries with the listing version's output settings."""
    saved = parameters["download"]
    return dataclasses.replace(
        timing,
        max_bytes=saved["max_bytes"],
        max_redirects=saved["max_redirects"],
        user_agent=saved["user_agent"],
        ignore_opt_outs=tuple(saved["ignore_opt_outs"]),
        allow_networks=parse_networks(saved["allow_networks"]),
    )


def write_retry_plan(store, extension: Extension, parameters: dict, shard_samples: int) -> PlanHeader:
    """The plan of a retry: every retryable reject's planned row, in key order, cut into shards of
    `shard_samples`. Holds the retryable keys and their rows (the planner's only: O(failures))."""
    keys = {row["key"] for row in jsonl_rows(store.get_bytes(REJECTS_NAME)) if row.get("retryable")}
    if not keys:
        raise UsageError(f"{store.url(REJECTS_NAME)}: no retryable rejects to download again")
    rows: dict[str, bytes] = {}  # a row retried before is in its retry's plan too: the first is kept
    for _, work, header in version_plans(store, extension.base):
        for key, rest in plan_lines(store, header, work) if header else ():
            if key in keys:
                rows.setdefault(key, rest)
    lines = sorted(rows.items())
    work, first = extension.work, extension.first_shard
    shards = (len(lines) + shard_samples - 1) // shard_samples
    body = b"".join(
        b'[%d,"%s",%s\n' % (first + i // shard_samples, key.encode(), rest) for i, (key, rest) in enumerate(lines)
    )
    store.put_bytes(work.slice(0), gzip.compress(body, compresslevel=1, mtime=0))
    store.put_bytes(work.duplicates, gzip.compress(b"", mtime=0))
    header = PlanHeader(
        fingerprint(parameters),
        parameters,
        list(extension.base["classes"]),
        0,
        shards,
        1,
        0,
        first,
        extension.first_position,
        retried=len(lines),
        job=_array_job(),
    )
    store.put_bytes(work.header, header.to_bytes())
    return header
