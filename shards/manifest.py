"""The dataset manifest (`dataset.json`) and the per-shard records it is merged from.

Layout of a destination:
    PREFIX-000000.tar, PREFIX-000000.idx, ...   the shards and their DALI indexes
    dataset.json                                written last; a reader trusts nothing else
    rejects.jsonl, duplicates.jsonl             what was left out, with the source and the reason
    _work/plan/header.json                      the shard plan's header (written last: its commit mark)
    _work/plan/part-00000.jsonl.gz, ...         the plan's items, one slice per part of the job
    _work/plan/duplicates.jsonl.gz              the duplicates --dedup found
    _work/plan/claim.json                       which task plans (only while it plans)
    _work/shards/PREFIX-000000.tar.json         one record per finished shard (its commit mark)
"""

from __future__ import annotations

import gzip
import json
from collections import Counter

from vitforge.core import UsageError, __version__
from .hf_parquet import shown_source
from .parallel import ordered_map
from .plan import DUPLICATES_PLAN, PlanHeader

FORMAT = "vitforge.shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "dataset.json"
REJECTS_NAME = "rejects.jsonl"
DUPLICATES_NAME = "duplicates.jsonl"
RECORDS_DIR = "_work/shards"
HISTOGRAMS = ("image_bytes", "short_side")


class ManifestError(UsageError):
    pass


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


def record_name(shard: str) -> str:
    return f"{RECORDS_DIR}/{shard}.json"


def merge(store, plan: PlanHeader, command: str, threads: int = 16) -> dict:
    """Combine every shard record into dataset.json (written last), rejects.jsonl, duplicates.jsonl.
    Records are read `threads` at a time (each read retried by the store), summed as they come."""
    names = [shard_name(plan.parameters["prefix"], i) for i in range(plan.shards)]
    present = set(store.list(RECORDS_DIR))
    missing = [n for n in names if record_name(n) not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ManifestError(f"{len(missing)} of {len(names)} shards are not finished yet: {shown}")
    rejects: list[dict] = []
    shards: list[dict] = []
    class_counts: Counter = Counter()
    normalised: Counter = Counter()
    histograms = {name: Counter() for name in HISTOGRAMS}
    read = ordered_map(lambda n: json.loads(store.get_bytes(record_name(n))), names, threads, chunk_size=1,
                       window_per_worker=2, threads=True)
    for record in read:
        rejects += record["rejects"]
        class_counts.update({int(k): v for k, v in record["class_counts"].items()})
        normalised.update(record["normalised"])
        for name, counter in histograms.items():
            counter.update({int(k): v for k, v in record[name].items()})
        shards.append({k: record[k] for k in ("name", "index", "samples", "bytes", "sha256", "index_sha256")})
    samples = sum(r["samples"] for r in shards)
    totals = {
        "inputs": plan.inputs, "samples": samples, "rejected": len(rejects),
        "duplicates": plan.duplicates, "bytes": sum(r["bytes"] for r in shards), "shards": len(shards),
    }
    if totals["inputs"] != samples + totals["rejected"] + totals["duplicates"]:
        raise ManifestError(f"accounting does not add up: {totals}")
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"vitforge {__version__}",
        "command": command, "parameters": plan.parameters, "plan_fingerprint": plan.fingerprint,
        # An unlabelled dataset (sharded with --no-labels) has no classes: num_classes is null.
        "classes": plan.classes, "num_classes": len(plan.classes) if labelled(plan.parameters) else None,
        "class_counts": [class_counts.get(i, 0) for i in range(len(plan.classes))],
        "totals": totals,
        "rejects_by_reason": dict(sorted(Counter(r["reason"] for r in rejects).items())),
        **_by_host(rejects),
        "normalised": dict(sorted(normalised.items())),
        # Samples per power-of-two band: key 65536 counts images of 64-128 KiB (0 when not validated).
        "histograms": {name: {str(k): v for k, v in sorted(c.items())} for name, c in histograms.items()},
        "shards": shards,
    }
    store.put_bytes(REJECTS_NAME, _jsonl(rejects))
    src = plan.parameters["src"]
    duplicates = [json.loads(line) for line in gzip.decompress(store.get_bytes(DUPLICATES_PLAN)).splitlines()]
    store.put_bytes(DUPLICATES_NAME, _jsonl(
        [{**d, "source": shown_source(d["source"], src), "duplicate_of": shown_source(d["duplicate_of"], src)}
         for d in duplicates]))
    store.put_bytes(MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")
    return manifest


HOSTS_SHOWN = 20


def _by_host(rejects: list[dict]) -> dict:
    """A URL list's failures per host, the HOSTS_SHOWN hosts with the most (bounded, whatever the
    list's length): {"rejects_by_host": {host: {reason: count}}}; nothing for other corpora."""
    hosts: dict[str, Counter] = {}
    for reject in rejects:
        if reject.get("host"):
            hosts.setdefault(reject["host"], Counter())[reject["reason"]] += 1
    if not hosts:
        return {}
    top = sorted(hosts.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))[:HOSTS_SHOWN]
    return {"rejects_by_host": {host: dict(sorted(reasons.items())) for host, reasons in top}}


def labelled(parameters: dict) -> bool:
    return parameters.get("labels", True)


def read_manifest(store) -> dict:
    try:
        manifest = json.loads(store.get_bytes(MANIFEST_NAME))
    except FileNotFoundError:
        raise ManifestError(f"{store.url(MANIFEST_NAME)}: no dataset manifest (sharding unfinished?)") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{store.url(MANIFEST_NAME)}: not valid JSON ({e.msg})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{store.url(MANIFEST_NAME)}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    return manifest


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in rows)
