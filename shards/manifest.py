"""The dataset manifest (`dataset.json`) and the per-shard records it is merged from (the
destination's layout is in layout.py).

A manifest describes one version of a dataset, whole: version 1 is what `vitforge shard` made;
each `--extend` adds a version that lists every shard of the one before plus its own, with totals,
class counts and histograms over all of them, and a `history` of what each version added. Each
version's manifest stays as dataset.vN.json, so a reader pinned to it keeps reading that set.
"""

from __future__ import annotations

import gzip
import json
import shlex
from collections import Counter
from dataclasses import dataclass, field

from vitforge.core import UsageError, __version__

from .hf_parquet import shown_source
from .layout import DUPLICATES_NAME, FIRST, MANIFEST_NAME, REJECTS_NAME, Work, shard_name, versioned_manifest_name
from .parallel import ordered_map
from .plan_slices import PlanHeader
from .records import display_path

FORMAT = "vitforge.shards"
FORMAT_VERSION = 1
HISTOGRAMS = ("image_bytes", "short_side")


class ManifestError(UsageError):
    pass


@dataclass
class _Contents:
    """What a manifest lists and sums over its shards: their records, rejects and duplicates, and
    the class counts, normalisations and histograms."""

    shards: list[dict] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)
    duplicates: list[dict] = field(default_factory=list)
    class_counts: Counter = field(default_factory=Counter)
    normalised: Counter = field(default_factory=Counter)
    histograms: dict[str, Counter] = field(default_factory=lambda: {name: Counter() for name in HISTOGRAMS})


def merge(
    store, plan: PlanHeader, command: str, threads: int = 16, work: Work = FIRST, base: dict | None = None
) -> dict:
    """Combine every shard record into dataset.json (written last), rejects.jsonl, duplicates.jsonl.
    Records are read `threads` at a time (each read retried by the store), summed as they come.
    `base`: the manifest of the version this plan extends; the new version holds it whole."""
    names = [shard_name(plan.parameters["prefix"], i) for i in plan.all_shards()]
    _check_finished(store, work, names)
    contents = _read_records(store, work, names, threads)
    added = _added(plan, contents)
    contents.duplicates = _duplicates(store, work, plan.parameters["src"])
    history = [
        {
            "version": 1 if base is None else version_of(base) + 1,
            "command": command,
            "plan_fingerprint": plan.fingerprint,
            "added": added,
            **({"retried": plan.retried} if plan.retried else {}),
            **({"array_job": plan.job} if plan.job else {}),
        }
    ]
    totals = added
    if base is not None:
        totals = _add_base(store, work, base, plan, contents, added)
        history = history_of(base) + history
    manifest = _manifest(plan, base, history, totals, contents)
    store.put_bytes(REJECTS_NAME, _jsonl(contents.rejects))
    store.put_bytes(DUPLICATES_NAME, _jsonl(contents.duplicates))
    text = _manifest_bytes(manifest)
    if base is not None and not store.exists(versioned_manifest_name(version_of(base))):
        # A dataset made before versions were kept: its manifest becomes its version's file.
        store.put_bytes(versioned_manifest_name(version_of(base)), _manifest_bytes(base))
    store.put_bytes(versioned_manifest_name(manifest["version"]), text)
    store.put_bytes(MANIFEST_NAME, text)
    return manifest


def _check_finished(store, work: Work, names: list[str]) -> None:
    """Refuses to merge while any shard's record is missing."""
    present = set(store.list(work.records_dir))
    missing = [n for n in names if work.record(n) not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ManifestError(f"{len(missing)} of {len(names)} shards are not finished yet: {shown}")


def _read_records(store, work: Work, names: list[str], threads: int) -> _Contents:
    """The shards' records, read `threads` at a time and summed as they come."""
    contents = _Contents()
    read = ordered_map(
        lambda n: json.loads(store.get_bytes(work.record(n))),
        names,
        threads,
        chunk_size=1,
        window_per_worker=2,
        threads=True,
    )
    for record in read:
        contents.rejects += record["rejects"]
        contents.class_counts.update({int(k): v for k, v in record["class_counts"].items()})
        contents.normalised.update(record["normalised"])
        for name, counter in contents.histograms.items():
            counter.update({int(k): v for k, v in record[name].items()})
        contents.shards.append({k: record[k] for k in ("name", "index", "samples", "bytes", "sha256", "index_sha256")})
    return contents


def _added(plan: PlanHeader, contents: _Contents) -> dict:
    """What this version adds, checked to account for every planned input."""
    samples = sum(r["samples"] for r in contents.shards)
    added = {
        "inputs": plan.inputs,
        "samples": samples,
        "rejected": len(contents.rejects),
        "duplicates": plan.duplicates,
        "bytes": sum(r["bytes"] for r in contents.shards),
        "shards": len(contents.shards),
    }
    if added["inputs"] + plan.retried != samples + added["rejected"] + added["duplicates"]:
        raise ManifestError(f"accounting does not add up: {added}, {plan.retried} retried")
    return added


def _duplicates(store, work: Work, src: str) -> list[dict]:
    """The plan's duplicates, their sources shown as the manifest shows them."""
    duplicates = [json.loads(line) for line in gzip.decompress(store.get_bytes(work.duplicates)).splitlines()]
    return [
        {**d, "source": shown_source(d["source"], src), "duplicate_of": shown_source(d["duplicate_of"], src)}
        for d in duplicates
    ]


def _add_base(store, work: Work, base: dict, plan: PlanHeader, contents: _Contents, added: dict) -> dict:
    """The version this plan extends, put before this version's `contents`; returns the totals of
    both. A retry's rejects, every one retried, leave the base's rejects and `added`'s count."""
    base_rejects = jsonl_rows(store.get_bytes(work.base_rejects))
    if plan.retried:  # every retryable reject was retried: it is a sample now, or one of `rejects`
        base_rejects = [r for r in base_rejects if not r.get("retryable")]
        added["rejected"] -= plan.retried
    contents.class_counts.update(dict(enumerate(base["class_counts"])))
    contents.normalised.update(base["normalised"])
    for name, counter in contents.histograms.items():
        counter.update({int(k): v for k, v in base["histograms"][name].items()})
    contents.rejects = base_rejects + contents.rejects
    contents.duplicates = jsonl_rows(store.get_bytes(work.base_duplicates)) + contents.duplicates
    contents.shards = base["shards"] + contents.shards
    return {k: base["totals"][k] + v for k, v in added.items()}


def _manifest(plan: PlanHeader, base: dict | None, history: list[dict], totals: dict, contents: _Contents) -> dict:
    first = history[0]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"vitforge {__version__}",
        # The first version's definition; what each later one added is in history.
        "command": first["command"],
        "parameters": base["parameters"] if base else plan.parameters,
        "plan_fingerprint": first["plan_fingerprint"],
        "version": history[-1]["version"],
        "history": history,
        # An unlabelled dataset (sharded with --no-labels) has no classes: num_classes is null.
        "classes": plan.classes,
        "num_classes": len(plan.classes) if labelled(plan.parameters) else None,
        "class_counts": [contents.class_counts.get(i, 0) for i in range(len(plan.classes))],
        "totals": totals,
        "rejects_by_reason": dict(sorted(Counter(r["reason"] for r in contents.rejects).items())),
        **_by_host(contents.rejects),
        "normalised": dict(sorted(contents.normalised.items())),
        # Samples per power-of-two band: key 65536 counts images of 64-128 KiB (0 when not validated).
        "histograms": {name: {str(k): v for k, v in sorted(c.items())} for name, c in contents.histograms.items()},
        "shards": contents.shards,
    }


def added(entry: dict) -> str:
    """What one version of the history added, in words."""
    a = entry["added"]
    if entry.get("retried"):
        return (
            f"retried {entry['retried']} rejects: {a['samples']} packed now, "
            f"{entry['retried'] - a['samples']} still rejected, {a['shards']} shards"
        )
    return (
        f"added {a['inputs']} inputs = {a['samples']} packed + {a['rejected']} rejected + {a['duplicates']} "
        f"duplicates, {a['shards']} shards"
    )


def version_of(manifest: dict) -> int:
    return manifest.get("version", 1)


def history_of(manifest: dict) -> list[dict]:
    """What each version added; for a manifest made before versions, its one version."""
    return manifest.get("history") or [
        {
            "version": 1,
            "command": manifest["command"],
            "plan_fingerprint": manifest["plan_fingerprint"],
            "added": manifest["totals"],
        }
    ]


def jsonl_rows(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"


def command_line(parameters: dict) -> str:
    """The command that reproduces a dataset; DEST stands for the folder the manifest sits in."""
    if parameters.get("retry_of"):
        return "vitforge shard --retry-failed DEST"
    image = parameters["image"]
    args = [
        "vitforge",
        "shard",
        parameters["src"],
        "DEST",
        "--prefix",
        parameters["prefix"],
        "--seed",
        str(parameters["seed"]),
    ]
    args += ["--shard-bytes", str(parameters["shard_bytes"])] if parameters["shard_bytes"] else []
    args += ["--shard-samples", str(parameters["shard_samples"])] if parameters["shard_samples"] else []
    args += [
        "--format",
        image["format"],
        "--quality",
        str(image["quality"]),
        "--min-side",
        str(image["min_side"]),
        "--max-pixels",
        str(image["max_pixels"]),
    ]
    args += ["--max-side", str(image["max_side"])] if image["max_side"] else []
    args += [] if image["validate"] else ["--no-validate"]
    args += ["--dedup"] if parameters["dedup"] else []
    args += ["--classes", parameters["classes_file"]] if parameters["classes_file"] else []
    if parameters.get("url_column"):
        args += _url_args(parameters)
    elif parameters.get("image_column"):
        args += ["--image-col", parameters["image_column"]]
    else:
        args += ["--path-column", parameters["path_column"]]
    args += [a for column in parameters.get("meta_columns") or () for a in ("--meta-col", column)]
    args += ["--label-column", parameters["label_column"]] if labelled(parameters) else ["--no-labels"]
    args += ["--root", parameters["root"]] if parameters.get("root") else []
    args += ["--follow-symlinks"] if parameters.get("follow_symlinks") else []
    args += ["--extend"] if parameters.get("extend") else []
    return shlex.join(display_path(a) for a in args)


def _url_args(parameters: dict) -> list[str]:
    download = parameters["download"]
    args = ["--url-col", parameters["url_column"]]
    args += ["--caption-col", parameters["caption_column"]] if parameters["caption_column"] else []
    args += [
        "--max-body",
        str(download["max_bytes"]),
        "--max-redirects",
        str(download["max_redirects"]),
        "--user-agent",
        download["user_agent"],
    ]
    args += [a for name in download["ignore_opt_outs"] for a in ("--ignore-opt-out", name)]
    return args + [a for network in download["allow_networks"] for a in ("--allow-network", network)]


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


def read_manifest(store, name: str = MANIFEST_NAME) -> dict:
    """The latest version's manifest, or with `name` "dataset.vN.json" version N's."""
    try:
        manifest = json.loads(store.get_bytes(name))
    except FileNotFoundError:
        raise ManifestError(f"{store.url(name)}: no dataset manifest (sharding unfinished?)") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{store.url(name)}: not valid JSON ({e.msg})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{store.url(name)}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    return manifest


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in rows)
