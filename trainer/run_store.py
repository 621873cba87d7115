"""A training run in object storage: its checkpoints, manifests, `latest` pointer and retention (its
ownership lease: lease.py). Plain I/O over `vitforge.core` stores; no torch, no collectives, so `vitforge ckpt`
uses it as it is.

Layout of DIR/RUN (a local folder, file:// or s3://):
    step_NNNNNNNN/...                 DeepSpeed's files, rank{r}_state.pt, shared_state.pt
    step_NNNNNNNN/receipts/rank{r}.json   what rank r uploaded (name, bytes, sha256)
    step_NNNNNNNN/manifest.json       written by rank 0 after every receipt: the checkpoint exists from here
    step_NNNNNNNN/universal/...       the checkpoint as DeepSpeed's universal checkpoint, published by the
                                      first resume at another world size (any world size loads it)
    step_NNNNNNNN/universal.json      its files with bytes and sha256, written after them: it exists from here
    latest                            the newest complete tag, written after its manifest
    lease.json                        which job (and SLURM restart) owns the run: rank 0 rewrites it every
                                      few seconds; another job judges it dead only when its version stays
                                      unchanged for a lease period on that job's own monotonic clock. It
                                      also holds the run's id and the published tags: a checkpoint is
                                      complete once its manifest exists AND its tag is listed there
    metrics.jsonl                     the run's metrics up to the newest checkpoint
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from vitforge.core import CheckpointError, Store, open_store, sha256_file

MANIFEST = "manifest.json"
LATEST = "latest"
LEASE = "lease.json"
METRICS = "metrics.jsonl"
RECEIPTS = "receipts"
UNIVERSAL = "universal"
UNIVERSAL_MARKER = "universal.json"
TAG = re.compile(r"^step_(\d{8,})$")
MANIFEST_VERSION = 2
UPLOAD_FILES = 2  # files a rank uploads at once: a small one need not wait behind a large one
log = logging.getLogger("vitforge.checkpoint")
T = TypeVar("T")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    match = TAG.match(tag)
    if not match:
        raise CheckpointError(f"{tag!r} is not a checkpoint name (step_NNNNNNNN)")
    return int(match.group(1))


def parse_record(data: bytes) -> dict:
    """A lease record (lease.py) as a dict; {} when it is not one."""
    try:
        value = json.loads(data)
        return value if isinstance(value, dict) else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def published_tags(record: dict) -> dict[str, int | None] | None:
    """The checkpoints a lease record lists as published, each with the epoch of the holder that
    published it (None: adopted from a run that predates the list); None for a record without a
    list, whose manifests all count."""
    tags = record.get("checkpoints")
    if not isinstance(tags, dict):
        return None
    return {tag: epoch if isinstance(epoch, int) else None for tag, epoch in tags.items() if TAG.match(tag)}


def split_checkpoint_url(url: str) -> tuple[str, str | None]:
    """'DIR/RUN/step_00000012' -> ('DIR/RUN', 'step_00000012'); 'DIR/RUN' -> ('DIR/RUN', None)."""
    head, _, last = url.rstrip("/").rpartition("/")
    return (head, last) if TAG.match(last) else (url.rstrip("/"), None)


@dataclass
class RunStore:
    url: str  # DIR/RUN
    store: Store = field(init=False, repr=False)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        self.store = open_store(self.url, work_dir=".tmp")

    def object_url(self, name: str) -> str:
        return self.store.url(name)

    # -- what exists -------------------------------------------------------------------------
    def step_folders(self) -> dict[str, dict[str, int]]:
        """Every step folder, complete or not: tag -> {relative name: bytes}."""
        folders: dict[str, dict[str, int]] = {}
        for name, size in self.store.walk("").items():
            tag, _, rest = name.partition("/")
            if TAG.match(tag) and rest:
                folders.setdefault(tag, {})[rest] = size
        return dict(sorted(folders.items(), key=lambda kv: step_of(kv[0])))

    def complete_tags(self) -> list[str]:
        """Tags with a manifest that the lease lists as published, oldest first (a run whose lease
        predates the list: every tag with a manifest). A step folder without both does not exist."""
        published = self.published()
        return [
            tag
            for tag, files in self.step_folders().items()
            if MANIFEST in files and (published is None or tag in published)
        ]

    def lease_record(self) -> dict:
        try:
            return parse_record(self.store.get_bytes(LEASE))
        except FileNotFoundError:
            return {}

    def published(self) -> dict[str, int | None] | None:
        """The tags the run's holders published (Lease.publish), with the publishing holder's epoch;
        None when the lease does not say."""
        return published_tags(self.lease_record())

    def latest(self) -> str | None:
        """The tag `latest` points at, or None: a pointer only (resume lists the checkpoints
        themselves), so one that is not a tag is warned about and ignored, never an error."""
        try:
            pointer = self.store.get_bytes(LATEST)
        except FileNotFoundError:
            return None
        tag = pointer.decode(errors="replace").strip()
        if not TAG.match(tag):
            log.warning("%s: not a checkpoint tag (%d bytes): ignored", self.object_url(LATEST), len(pointer))
            return None
        return tag

    def manifest(self, tag: str) -> dict:
        """The manifest of `tag`. A CheckpointError when it is missing or unreadable, says another
        step than its folder's, was never published by the run's holder or not by its writer (a
        stale copy's manifest that landed over a published one), or names another run."""
        try:
            manifest = json.loads(self.store.get_bytes(f"{tag}/{MANIFEST}"))
        except FileNotFoundError:
            raise CheckpointError(f"{self.object_url(tag)}: no {MANIFEST}: the checkpoint is incomplete") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.object_url(f'{tag}/{MANIFEST}')}: not valid JSON ({e})") from None
        url = self.object_url(f"{tag}/{MANIFEST}")
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "step" not in manifest:
            raise CheckpointError(f"{url}: not a vitforge checkpoint manifest")
        if manifest["step"] != step_of(tag):
            raise CheckpointError(
                f"{url}: says step {manifest['step']!r}, but its folder is {tag}: not this "
                "folder's checkpoint (copied or edited)"
            )
        record = self.lease_record()
        published = published_tags(record)
        if published is not None and tag not in published:
            raise CheckpointError(
                f"{self.object_url(tag)}: never published by the run's holder (its manifest was "
                "written by a copy that no longer held the run, or its commit was cut off): not "
                "part of the run"
            )
        if published is not None and published[tag] is not None and manifest.get("epoch") != published[tag]:
            raise CheckpointError(
                f"{url}: written by the run's holder of epoch {manifest.get('epoch')!r}, but the "
                f"holder of epoch {published[tag]} published this step: a stale copy's manifest "
                "landed over the published one"
            )
        theirs, mine = manifest.get("run_id"), record.get("run_id")
        if theirs and mine and theirs != mine:
            raise CheckpointError(
                f"{url}: belongs to run {theirs} (checkpoint.run {_run_name(manifest)}), not to "
                f"this run, {mine} (its lease {self.object_url(LEASE)}): copied from another run"
            )
        return manifest

    def results(self) -> dict:
        """What the run reached: its newest complete checkpoint's step, training-set size and
        config, and the last evaluation in the run's metrics.jsonl."""
        tags = self.complete_tags()
        if not tags:
            raise CheckpointError(f"{self.url}: no complete checkpoint: the run has not finished a step")
        manifest = self.manifest(tags[-1])
        try:
            lines = [json.loads(line) for line in self.store.get_bytes(METRICS).decode().splitlines() if line.strip()]
        except FileNotFoundError:
            lines = []
        evals = [line for line in lines if any(key.startswith("eval_") for key in line)]
        return {
            "step": manifest["step"],
            "train_samples": manifest.get("train_samples"),
            "num_classes": manifest.get("num_classes"),
            "config": manifest.get("config", {}),
            **(evals[-1] if evals else {}),
        }

    def candidates(self, resume: str | int) -> list[str]:
        """Tags to try, best first: for "auto" every complete one, newest first; else just the one asked for."""
        if resume == "never":
            return []
        if resume == "auto":
            return list(reversed(self.complete_tags()))
        tag = tag_for(resume) if isinstance(resume, int) else split_checkpoint_url(resume)[1]
        if tag is None:
            raise CheckpointError(f"{resume}: names no step_NNNNNNNN checkpoint")
        return [tag]

    def first_usable(self, candidates: list[str], attempt: Callable[[str], T], explicit: bool, advice: str = "") -> T:
        """`attempt(tag)` on each candidate, best first, until one succeeds. A CheckpointError
        (unreadable manifest, missing or corrupt file, weights that do not load) passes over that
        checkpoint with a warning saying why, unless it was asked for by name (`explicit`): then
        it is raised. The same choice for `train`'s resume and for every reader of a run URL."""
        for n, tag in enumerate(candidates):
            try:
                return attempt(tag)
            except CheckpointError as e:
                if explicit:
                    raise
                later = candidates[n + 1] if n + 1 < len(candidates) else None
                log.warning(
                    "checkpoint %s is unusable: %s; %s",
                    self.object_url(tag),
                    e,
                    f"falling back to {later}" if later else "no older complete checkpoint",
                )
        raise CheckpointError(
            f"{self.url}: no usable checkpoint among {', '.join(candidates)} (see the warnings above){advice}"
        )

    # -- checking and fetching ---------------------------------------------------------------
    def listed_problems(self, tag: str, manifest: dict, present: dict[str, int]) -> list[str]:
        """Files the manifest lists that the listing `present` (name -> bytes) lacks or has at
        another size: what a listing can tell without reading a byte."""
        problems = []
        for name, meta in sorted(manifest["files"].items()):
            if name not in present:
                problems.append(f"{self.object_url(f'{tag}/{name}')}: missing")
            elif present[name] != meta["bytes"]:
                problems.append(
                    f"{self.object_url(f'{tag}/{name}')}: {present[name]} bytes, the manifest says {meta['bytes']}"
                )
        return problems

    def fetch(self, tag: str, names: list[str], manifest: dict, folder: str, threads: int = 2) -> str:
        """Make `names` of checkpoint `tag` available on local disk with their sha256 checked before
        anything reads them. Local stores are hashed in place; remote ones are downloaded in
        parallel into `folder`/tag. Returns the folder that holds `tag/...`. A missing file or a
        checksum mismatch is a CheckpointError naming the file."""
        files = manifest["files"]
        local_root = self.store.local_path("")
        target = local_root if local_root is not None else folder

        def one(name: str) -> None:
            if name not in files:
                raise CheckpointError(f"{self.object_url(f'{tag}/{name}')}: not listed in the manifest")
            path = os.path.join(target, tag, name)
            if local_root is None:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    digest = self.store.download(f"{tag}/{name}", path)  # hashed as it arrives
                except FileNotFoundError:
                    raise CheckpointError(f"{self.object_url(f'{tag}/{name}')}: missing") from None
            elif not os.path.exists(path):
                raise CheckpointError(f"{self.object_url(f'{tag}/{name}')}: missing")
            else:
                digest = None
            size = os.path.getsize(path)
            if size != files[name]["bytes"]:
                raise CheckpointError(
                    f"{self.object_url(f'{tag}/{name}')}: {size} bytes, the manifest says {files[name]['bytes']}"
                )
            if (digest or sha256_file(path)) != files[name]["sha256"]:
                raise CheckpointError(f"{self.object_url(f'{tag}/{name}')}: sha256 differs from the manifest (corrupt)")

        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(one, n) for n in sorted(names)]:
                future.result()
        return target

    def verify(self, tag: str) -> list[str]:
        """Every problem of one checkpoint (missing, wrong size, wrong sha256), each naming the file."""
        try:
            manifest = self.manifest(tag)
        except CheckpointError as e:
            return [str(e)]
        return self._problems(tag, manifest, self.step_folders().get(tag, {}))

    def _problems(self, tag: str, listing: dict, present: dict[str, int]) -> list[str]:
        """Every problem of the files `listing` (a manifest or a marker) gives for `tag`, against
        the store's listing `present`: each file read once, at most 4 on local disk at a time."""
        problems = self.listed_problems(tag, listing, present)
        checkable = [n for n in listing["files"] if present.get(n) == listing["files"][n]["bytes"]]
        with tempfile.TemporaryDirectory(prefix="vitforge-verify-") as scratch:

            def check(name: str) -> str | None:
                try:
                    self.fetch(tag, [name], listing, scratch)
                except CheckpointError as e:
                    return str(e)
                finally:
                    if self.store.local_path("") is None:
                        _remove(os.path.join(scratch, tag, name))
                return None

            with ThreadPoolExecutor(4) as pool:
                problems += [p for p in pool.map(check, sorted(checkable)) if p]
        return problems

    # -- the universal checkpoint beside a checkpoint -----------------------------------------
    def universal(self, tag: str) -> dict | None:
        """The marker of `tag`'s published universal checkpoint ({"files": {name: bytes, sha256}},
        names relative to the tag, as in a manifest), or None: never published, or cut short before
        its marker (files without a marker are never read), or a marker that does not parse."""
        try:
            marker = json.loads(self.store.get_bytes(f"{tag}/{UNIVERSAL_MARKER}"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            log.warning("%s: not valid JSON (%s); ignored", self.object_url(f"{tag}/{UNIVERSAL_MARKER}"), e)
            return None
        return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None

    def universal_problems(self, tag: str) -> tuple[dict | None, list[str]]:
        """`tag`'s published universal checkpoint as it is now: its marker (None: none, then that
        is the problem) and every problem of its files against it (missing, size, sha256)."""
        marker = self.universal(tag)
        if marker is None:
            return None, [f"{self.object_url(f'{tag}/{UNIVERSAL_MARKER}')}: missing or unreadable"]
        present = {name.removeprefix(f"{tag}/"): size for name, size in self.store.walk(f"{tag}/{UNIVERSAL}").items()}
        return marker, self._problems(tag, marker, present)

    def publish_universal(self, tag: str, folder: str, about: dict) -> dict:
        """Upload the universal checkpoint in local `folder` to `tag`/universal/, then its marker;
        returns the marker. What an earlier attempt left there is deleted first, its marker before
        its files, so a marker never lists a file of another conversion."""
        leftovers = sorted(self.store.walk(f"{tag}/{UNIVERSAL}"))
        self.store.delete([f"{tag}/{UNIVERSAL_MARKER}"])
        if leftovers:
            self.store.delete(leftovers)
        files = self.upload_folder(folder, f"{tag}/{UNIVERSAL}")
        marker = {**about, "files": {f"{UNIVERSAL}/{name}": meta for name, meta in sorted(files.items())}}
        self.put_bytes(f"{tag}/{UNIVERSAL_MARKER}", json.dumps(marker, indent=1, sort_keys=True).encode())
        return marker

    # -- writing -----------------------------------------------------------------------------
    def upload(self, local_path: str, name: str) -> None:
        self.store.put_file(local_path, name, keep=True)

    def upload_folder(self, root: str, prefix: str) -> dict[str, dict]:
        """Every file under local `root` to `prefix`/..., UPLOAD_FILES at a time; returns {name relative
        to root: {"bytes", "sha256"}} for a receipt or a marker. The sha256 is of the very bytes sent
        where the store hashes them as it reads them (S3: one read, one hash, one send per byte, and
        the client adds no checksum of its own); other stores' files are hashed after their upload.
        Per rank: UPLOAD_FILES threads, each with the store's UPLOAD_THREADS part threads; on S3 each
        file holds UPLOAD_THREADS + 1 parts in memory (2 x 5 x 64 MiB = 640 MiB at most)."""
        names = sorted(os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns)

        def one(name: str) -> tuple[str, dict]:
            path = os.path.join(root, name)
            digest = self.store.put_file(path, f"{prefix}/{name}", keep=True) or sha256_file(path)
            return name, {"bytes": os.path.getsize(path), "sha256": digest}

        with ThreadPoolExecutor(UPLOAD_FILES) as pool:
            return dict(pool.map(one, names))

    def put_bytes(self, name: str, data: bytes) -> None:
        self.store.put_bytes(name, data)

    def receipts(self, tag: str) -> dict[int, dict]:
        names = list(self.store.walk(f"{tag}/{RECEIPTS}"))
        found = {}
        for name in names:
            match = re.search(r"rank(\d+)\.json$", name)
            if match:
                found[int(match.group(1))] = json.loads(self.store.get_bytes(name))
        return found

    def get_bytes(self, name: str) -> bytes:
        return self.store.get_bytes(name)

    def delete_tags(self, tags: list[str]) -> None:
        """Manifests first: a deletion cut short leaves an incomplete folder (cleaned up later),
        never a manifest that lists files which are gone."""
        folders = self.step_folders()
        manifests = [f"{tag}/{MANIFEST}" for tag in tags if MANIFEST in folders.get(tag, {})]
        rest = [f"{tag}/{name}" for tag in tags for name in sorted(folders.get(tag, {})) if name != MANIFEST]
        for names in (manifests, rest):
            if names:
                self.store.delete(names)

    def retention(self, keep_last: int | None, keep_every: int | None, newest: str) -> list[str]:
        """Delete complete checkpoints beyond the newest `keep_last` unless their step is a multiple
        of `keep_every`. Runs only after `newest` is complete, so nothing is lost to a crash."""
        if keep_last is None:
            return []
        complete = [t for t in self.complete_tags() if step_of(t) <= step_of(newest)]
        doomed = [t for t in complete[:-keep_last] if not (keep_every and step_of(t) % keep_every == 0)]
        self.delete_tags(doomed)
        return doomed

    def clean_incomplete(self) -> tuple[list[str], int]:
        """Remove what dead attempts left: step folders without a manifest and unfinished multipart
        uploads. Call only while holding the lease, before this job writes anything."""
        incomplete = [tag for tag, files in self.step_folders().items() if MANIFEST not in files]
        self.delete_tags(incomplete)
        return incomplete, self.store.abort_uploads("")


def _run_name(manifest: dict) -> str:
    config = manifest.get("config")
    checkpoint = config.get("checkpoint") if isinstance(config, dict) else None
    return repr(checkpoint.get("run")) if isinstance(checkpoint, dict) else "unknown"


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
