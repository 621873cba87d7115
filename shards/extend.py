"""`vitforge shard SRC DEST --extend`: add a version to a finished dataset.

The new version lists every shard of the latest one, untouched, plus its own: numbered on from the
last shard, with sample keys numbered on from the last planned input, so no name or key repeats.
Class ids stay: the new corpus's classes are matched to the dataset's by name and the unknown ones
appended. An extension always deduplicates by content, against itself and against every sample
planned before (the earlier plans' digests when they kept them; otherwise each sample's recorded
sha256, read from the shards' JSON). Images are packed with the dataset's own settings (the same
prefix, labelling and image options are required); shard sizes, seed and columns may differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tarfile
import tempfile
from dataclasses import dataclass

import numpy as np

from vitforge.core import UsageError

from .digests import DigestTable
from .layout import DUPLICATES_NAME, MANIFEST_NAME, REJECTS_NAME, Work
from .manifest import ManifestError, history_of, jsonl_rows, read_manifest, version_of
from .parallel import ordered_map
from .plan_slices import read_header
from .tarfile_writer import split_name

log = logging.getLogger("vitforge.shard")

# What the new version must share with the dataset: a reader decodes every shard alike.
KEPT = ("prefix", "labels", "image")


@dataclass
class Extension:
    """The dataset an `--extend` job adds to: its latest manifest (one row per shard, held by the
    planner and the merge only) and where the new version's work goes."""

    base: dict
    work: Work
    done: bool  # this very extension is already the latest version

    @property
    def version(self) -> int:
        return version_of(self.base) + 1

    @property
    def first_shard(self) -> int:
        return len(self.base["shards"])

    @property
    def first_position(self) -> int:
        """Every planned input took a position (its sample key); the next one is free."""
        return self.base["totals"]["inputs"] - self.base["totals"]["duplicates"]

    def snapshot(self, store) -> None:
        """Keep the base's rejects and duplicates as this plan found them: the merge writes the
        files anew from these plus its own (so a merge run again, or a retry's, repeats nothing)."""
        for name, kept in ((REJECTS_NAME, self.work.base_rejects), (DUPLICATES_NAME, self.work.base_duplicates)):
            store.put_bytes(kept, store.get_bytes(name))

    def classes(self, names: list[str], labels) -> list[str]:
        """The dataset's classes with `names`' new ones appended; `labels` (an array('i') of ids
        into `names`, -1 for none) rewritten in place to ids into the result."""
        classes = list(self.base["classes"])
        ids = {name: i for i, name in enumerate(classes)}
        for name in names:
            if name not in ids:
                ids[name] = len(classes)
                classes.append(name)
        if names and len(labels):
            mapping = np.array([ids[name] for name in names] + [-1], dtype=np.int32)
            column = np.frombuffer(labels, dtype=np.int32)
            column[:] = mapping[column]  # -1 indexes the trailing -1
        return classes


def open_extension(store, dest: str, parameters: dict, fingerprint: str) -> Extension:
    """The extension of DEST's latest version by a job with these output parameters; refuses a
    destination without a finished dataset or one made with other image settings."""
    try:
        base = read_manifest(store)
    except ManifestError:
        if not store.exists(MANIFEST_NAME):
            raise UsageError(
                f"{dest}: no finished dataset to extend (no {MANIFEST_NAME}); shard into it without "
                "--extend first, or finish that run"
            ) from None
        raise
    if any(entry["plan_fingerprint"] == fingerprint for entry in history_of(base)):
        return Extension(base, Work.of(version_of(base)), done=True)  # this extension is in it already
    differ = [key for key in KEPT if base["parameters"].get(key) != parameters[key]]
    if differ:
        shown = "; ".join(
            f"{key}: {base['parameters'].get(key)!r} in the dataset, {parameters[key]!r} here" for key in differ
        )
        raise UsageError(f"{dest}: an extension packs images as the dataset does: {shown}")
    return Extension(base, Work.of(version_of(base) + 1), done=False)


def version_plans(store, base: dict):
    """(history entry, its work folder, its plan header or None) for each version, oldest first."""
    for entry in history_of(base):
        work = Work.of(entry["version"])
        yield entry, work, read_header(store, work)


def existing_digests(store, base: dict, url_list: bool, workers: int) -> DigestTable:
    """The digests of every sample in the dataset of the kind this extension compares: URLs for a
    URL list, contents otherwise (a version of the other kind is not compared). Each version's kept
    digests, or for a version that kept none, its shards' recorded sha256s (or URLs). Rows that are
    rejects are left out (a URL that timed out may be listed again); the latest version comes first,
    so a row a retry packed is named where it is now."""
    tables, first = [], 0
    for entry, work, header in version_plans(store, base):
        shards = range(first, first + entry["added"]["shards"])
        first = shards.stop
        if bool((header.parameters if header else base["parameters"]).get("url_column")) != url_list:
            continue
        if store.exists(work.digests):
            tables.append(DigestTable.from_bytes(store.get_bytes(work.digests)))
            continue
        log.info("version %d kept no content digests: reading them from its %d shards", entry["version"], len(shards))
        rows = ordered_map(
            lambda shard: _shard_digests(store, base["shards"][shard]["name"], shard, url_list),
            shards,
            workers,
            chunk_size=1,
            window_per_worker=2,
            threads=True,
        )
        tables += list(rows)
    table = DigestTable.concat(tables[::-1])
    rejected = np.array([int(row["key"]) for row in jsonl_rows(store.get_bytes(REJECTS_NAME))], dtype=np.uint64)
    return DigestTable(table.records[~np.isin(table.records["position"], rejected)])


def _shard_digests(store, name: str, shard: int, url_list: bool) -> DigestTable:
    digests, positions = [], []
    with (
        tempfile.TemporaryDirectory(prefix="vitforge-extend-") as tmp,
        tarfile.open(store.local_copy(name, tmp), "r:") as tar,
    ):
        for member in tar:
            key, ext = split_name(member.name)
            if ext != "json":
                continue
            info = json.loads(tar.extractfile(member).read())
            if url_list and "url" not in info:
                continue
            digest = hashlib.sha256(info["url"].encode()).digest() if url_list else bytes.fromhex(info["sha256"])
            digests.append(np.frombuffer(digest, dtype=np.uint8))
            positions.append(int(key))
    count = len(digests)
    return DigestTable.of(
        np.array(digests, dtype=np.uint8).reshape(count, 32), np.full(count, shard), np.array(positions, dtype=np.int64)
    )
