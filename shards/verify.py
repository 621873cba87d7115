"""`vitforge shard verify` and `vitforge shard info`: check a dataset against its manifest, summarise it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import tarfile
import tempfile

from vitforge.core import open_store, sha256_file

from .images import Rejected, check_decodes
from .manifest import added, read_manifest
from .parallel import ordered_map
from .tarfile_writer import SAMPLE_IMAGE_EXTS, format_dali_index, index_entry, split_name


def verify(dest: str, workers: int = 1) -> tuple[dict, list[str]]:
    """Return (manifest, problems); every problem names the shard (and sample) and the cause."""
    store = open_store(dest)
    manifest = read_manifest(store)
    check = functools.partial(_verify_shard, dest=dest, num_classes=manifest["num_classes"])
    problems = [p for found in ordered_map(check, manifest["shards"], workers, chunk_size=1) for p in found]
    total = sum(s["samples"] for s in manifest["shards"])
    if total != manifest["totals"]["samples"]:
        problems.append(f"manifest: shards hold {total} samples but totals say {manifest['totals']['samples']}")
    return manifest, problems


def _verify_shard(shard: dict, *, dest: str, num_classes: int | None) -> list[str]:
    store = open_store(dest)
    name = shard["name"]
    with tempfile.TemporaryDirectory(prefix="vitforge-verify-") as tmp:
        try:
            path = store.local_copy(name, tmp)
            stored_index = store.get_bytes(shard["index"])
        except (OSError, FileNotFoundError) as e:
            return [f"{name}: cannot read: {e}"]
        problems = []
        size = os.path.getsize(path)
        if size != shard["bytes"]:
            problems.append(f"{name}: {size} bytes, manifest says {shard['bytes']}")
        if sha256_file(path) != shard["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
        try:
            index, samples, sample_problems = _read_tar(path, num_classes)
        except (tarfile.TarError, OSError) as e:
            return [*problems, f"{name}: not a readable tar: {e}"]
        problems += [f"{name}: {p}" for p in sample_problems]
        if samples != shard["samples"]:
            problems.append(f"{name}: {samples} samples, manifest says {shard['samples']}")
        if index != stored_index:
            problems.append(f"{shard['index']}: does not match the tar (DALI would read wrong offsets)")
        elif hashlib.sha256(stored_index).hexdigest() != shard["index_sha256"]:
            problems.append(f"{shard['index']}: sha256 differs from the manifest")
        return problems


def _read_tar(path: str, num_classes: int | None) -> tuple[bytes, int, list[str]]:
    """Rebuild the DALI index from the tar itself and check every sample's members (a label below
    num_classes; none at all when num_classes is None: an unlabelled dataset)."""
    groups: list[tuple[str, list]] = []
    problems = []
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = split_name(member.name)
            if not groups or groups[-1][0] != key:
                groups.append((key, []))
            data = tar.extractfile(member).read()
            groups[-1][1].append((ext, member.offset_data, member.size, member.name, data))
    seen = set()
    for key, members in groups:
        if key in seen:
            problems.append(f"sample {key}: key appears in two places")
        seen.add(key)
        by_ext = {ext: data for ext, _, _, _, data in members}
        images = [e for e in by_ext if e in SAMPLE_IMAGE_EXTS]
        if len(images) != 1:
            problems.append(f"sample {key}: expected one image member, found {images or 'none'}")
        else:
            try:
                check_decodes(by_ext[images[0]])
            except Rejected as e:
                problems.append(f"sample {key}: image does not decode: {e.detail}")
        label = by_ext.get("cls", b"").decode("ascii", "replace")
        if num_classes is None:
            if "cls" in by_ext:
                problems.append(f"sample {key}: has a .cls label {label!r} but the dataset is unlabelled")
        elif not label.isdigit() or int(label) >= num_classes:
            problems.append(f"sample {key}: label {label!r} is not a class id below {num_classes}")
        if "json" in by_ext:
            try:
                json.loads(by_ext["json"])
            except ValueError:
                problems.append(f"sample {key}: .json member is not valid JSON")
    index = format_dali_index(
        [" ".join(index_entry(name, offset, size) for _, offset, size, name, _ in members) for _, members in groups]
    )
    return index, len(groups), problems


def info(dest: str) -> str:
    manifest = read_manifest(open_store(dest))
    totals = manifest["totals"]
    sizes = sorted(s["bytes"] for s in manifest["shards"])
    counts = manifest["class_counts"]
    lines = [
        f"dataset      {dest}",
        f"made by      {manifest['created_by']}: {manifest['command']}",
        f"samples      {totals['samples']} in {totals['shards']} shards, {_human(totals['bytes'])}"
        f" ({_human(totals['bytes'] / max(totals['samples'], 1))} per sample)",
        f"inputs       {totals['inputs']} = {totals['samples']} packed + {totals['rejected']} rejected"
        f" + {totals['duplicates']} duplicates",
        "classes      none (unlabelled)"
        if manifest["num_classes"] is None
        else f"classes      {manifest['num_classes']}; samples per class min {min(counts, default=0)},"
        f" median {statistics.median(counts) if counts else 0:g}, max {max(counts, default=0)}",
        f"shard sizes  min {_human(sizes[0] if sizes else 0)},"
        f" median {_human(statistics.median(sizes) if sizes else 0)},"
        f" max {_human(sizes[-1] if sizes else 0)}",
    ]
    if manifest.get("version", 1) > 1:
        lines.append(f"versions     {manifest['version']} (each one's manifest: dataset.vN.json)")
        lines += [f"  v{h['version']}: {added(h)}: {h['command']}" for h in manifest["history"]]
    lines += ["shard size histogram:", *_histogram(sizes)]
    lines += ["image size histogram (samples per band):", *_bands(manifest["histograms"]["image_bytes"], _human)]
    lines += [
        "shorter side histogram (samples per band):",
        *_bands(manifest["histograms"]["short_side"], lambda v: f"{v:.0f} px"),
    ]
    if manifest["rejects_by_reason"]:
        lines.append("rejected by reason: " + ", ".join(f"{k} {v}" for k, v in manifest["rejects_by_reason"].items()))
    if manifest["normalised"]:
        lines.append("normalised: " + ", ".join(f"{k} {v}" for k, v in manifest["normalised"].items()))
    return "\n".join(lines)


def _histogram(values: list[int], bands: int = 8) -> list[str]:
    if not values:
        return ["  (no shards)"]
    low, high = values[0], values[-1]
    width = max((high - low) / bands, 1)
    counts = [0] * bands
    for v in values:
        counts[min(int((v - low) / width), bands - 1)] += 1
    peak = max(counts)
    return [
        f"  {_human(low + i * width):>10} - {_human(low + (i + 1) * width):>10} {c:6d} {'#' * round(30 * c / peak)}"
        for i, c in enumerate(counts)
        if c
    ]


def _bands(counts: dict[str, int], show) -> list[str]:
    """Power-of-two bands from the manifest: band k holds values from k to 2k - 1."""
    if not counts or set(counts) == {"0"}:
        return ["  (not recorded: shards packed with --no-validate)"] if counts else ["  (no samples)"]
    peak = max(counts.values())
    return [
        f"  {show(int(k)):>10} - {show(2 * int(k)):>10} {v:6d} {'#' * round(30 * v / peak)}"
        for k, v in sorted(counts.items(), key=lambda kv: int(kv[0]))
    ]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
