"""`vitforge shard --retry-failed DEST`: download a URL-list dataset's retryable failures again.

A retry is an extension (see extend.py) whose inputs are the rows of every version's plan whose
reject is marked `retryable` (timeouts, connection errors, 408, 429, 5xx, robots.txt unavailable),
with their keys, labels and columns as planned: a row that now downloads becomes a sample under
the key it always had, in new shards; the others stay rejects. The dataset's totals keep each row
once (inputs do not grow; rejected shrinks by what came through). Rows are downloaded with the
settings that decide what a success holds (user agent, opt-outs, allowed networks, body and
redirect limits) of the version that listed them; only timing (concurrency, timeouts, retries)
comes from the command line. Run it again to retry what still fails.
"""

from __future__ import annotations

import dataclasses
import gzip
import json

from vitforge.core import UsageError

from .download import DownloadOptions
from .extend import Extension
from .layout import REJECTS_NAME, Work
from .manifest import history_of, jsonl_rows, read_manifest
from .plan import PlanHeader, fingerprint, read_header
from .url_guard import parse_networks

# Settings of a URL list that a retry takes from the version that listed the rows.
OUTPUT_DOWNLOAD = ("max_bytes", "max_redirects", "user_agent", "ignore_opt_outs", "allow_networks")


def retry_parameters(store, dest: str) -> dict:
    """The output parameters of the newest URL-list version of DEST's dataset, for a retry job."""
    base = read_manifest(store)
    for entry in reversed(history_of(base)):
        header = read_header(store, Work.of(entry["version"]))
        if header is not None and header.parameters.get("url_column"):
            return header.parameters
    raise UsageError(f"{dest}: --retry-failed downloads a URL list's failures again; no version of this dataset "
                     "was sharded from a URL list (--url-col)")


def download_options(parameters: dict, timing: DownloadOptions) -> DownloadOptions:
    """`timing`'s concurrency, timeouts and retries with the listing version's output settings."""
    saved = parameters["download"]
    return dataclasses.replace(timing, max_bytes=saved["max_bytes"], max_redirects=saved["max_redirects"],
                               user_agent=saved["user_agent"], ignore_opt_outs=tuple(saved["ignore_opt_outs"]),
                               allow_networks=parse_networks(saved["allow_networks"]))


def write_retry_plan(store, extension: Extension, parameters: dict, shard_samples: int) -> PlanHeader:
    """The plan of a retry: every retryable reject's planned row, in key order, cut into shards of
    `shard_samples`. Holds the retryable keys and their rows (the planner's only: O(failures))."""
    keys = {row["key"] for row in jsonl_rows(store.get_bytes(REJECTS_NAME)) if row.get("retryable")}
    if not keys:
        raise UsageError(f"{store.url(REJECTS_NAME)}: no retryable rejects to download again")
    rows: dict[str, bytes] = {}  # a row retried before is in its retry's plan too: the first is kept
    for entry in history_of(extension.base):
        work = Work.of(entry["version"])
        header = read_header(store, work)
        for part in range(header.parts if header else 0):
            for line in gzip.decompress(store.get_bytes(work.slice(part))).splitlines():
                shard, key, rest = line[1:].split(b",", 2)
                if json.loads(key) in keys:
                    rows.setdefault(json.loads(key), rest)
    lines = sorted(rows.items())
    work, first = extension.work, extension.first_shard
    shards = (len(lines) + shard_samples - 1) // shard_samples
    body = b"".join(b'[%d,"%s",%s\n' % (first + i // shard_samples, key.encode(), rest)
                    for i, (key, rest) in enumerate(lines))
    store.put_bytes(work.slice(0), gzip.compress(body, compresslevel=1, mtime=0))
    store.put_bytes(work.duplicates, gzip.compress(b"", mtime=0))
    header = PlanHeader(fingerprint(parameters), parameters, list(extension.base["classes"]), 0, shards, 1, 0,
                        first, extension.first_position, retried=len(lines))
    store.put_bytes(work.header, header.to_bytes())
    return header
