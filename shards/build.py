"""The sharder's main loop: plan, then pack each shard this part owns, then merge.

A shard exists only once its record (`_work/shards/NAME.json`) is written, and that happens after
the tar and its index are in place, so a run killed at any instant leaves either a complete shard
or one that the next run rebuilds from scratch to the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shlex
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from vitforge.core import Progress, StorageError, UsageError, open_store

from .images import ImageOptions, Rejected, normalise
from .manifest import HISTOGRAMS, PLAN_NAME, RECORDS_DIR, ManifestError, labelled, merge, record_name, shard_name
from .parallel import ordered_map
from .plan import Plan, PlanItem, fingerprint, make_plan
from .sources import display_path, list_corpus, load_class_names, read_source
from .tarfile_writer import TarShardWriter, index_path_for

log = logging.getLogger("vitforge.shard")


@dataclass(frozen=True)
class ShardJob:
    src: str
    dest: str
    prefix: str = "train"
    seed: int = 0
    shard_bytes: int | None = 1 << 30
    shard_samples: int | None = None
    image: ImageOptions = field(default_factory=ImageOptions)
    dedup: bool = False
    classes_file: str | None = None
    path_column: str = "path"
    label_column: str = "label"
    root: str | None = None  # manifest rows, and followed folder links, must resolve inside it
    labels: bool = True  # False: an unlabelled corpus (samples without a .cls member)
    follow_symlinks: bool = False  # follow symlinked folders below a folder SRC (inside root)
    workers: int = 1
    num_parts: int = 1
    part: int = 0

    def __post_init__(self):
        if not self.prefix or any(c in self.prefix for c in "./ "):
            raise UsageError(f"--prefix {self.prefix!r} must be non-empty without '.', '/' or spaces")
        if not self.shard_bytes and not self.shard_samples:
            raise UsageError("give --shard-bytes, --shard-samples or both")
        if not 0 <= self.part < self.num_parts:
            raise UsageError(f"--part {self.part} is outside 0..{self.num_parts - 1} (--num-parts {self.num_parts})")
        if not self.labels and self.classes_file:
            raise UsageError("--classes and --no-labels contradict each other")
        if self.workers < 1:
            raise UsageError(f"--workers must be >= 1, not {self.workers}")

    def output_parameters(self) -> dict:
        """Everything that shapes the output bytes, and nothing else (not workers, not part)."""
        return {
            "src": self.src, "prefix": self.prefix, "seed": self.seed, "shard_bytes": self.shard_bytes,
            "shard_samples": self.shard_samples, "image": asdict(self.image), "dedup": self.dedup,
            "classes_file": self.classes_file, "path_column": self.path_column, "label_column": self.label_column,
            "root": self.root, "labels": self.labels,
            # Only when set, so datasets sharded before the option existed keep their fingerprint.
            **({"follow_symlinks": True} if self.follow_symlinks else {}),
        }


@dataclass
class PartResult:
    shards_built: int
    shards_skipped: int
    shards_owned: int
    manifest: dict | None  # the dataset manifest, once every part is done


def command_line(parameters: dict) -> str:
    """The command that reproduces a dataset; DEST stands for the folder the manifest sits in."""
    image = parameters["image"]
    args = ["vitforge", "shard", parameters["src"], "DEST", "--prefix", parameters["prefix"],
            "--seed", str(parameters["seed"])]
    args += ["--shard-bytes", str(parameters["shard_bytes"])] if parameters["shard_bytes"] else []
    args += ["--shard-samples", str(parameters["shard_samples"])] if parameters["shard_samples"] else []
    args += ["--format", image["format"], "--quality", str(image["quality"]), "--min-side", str(image["min_side"]),
             "--max-pixels", str(image["max_pixels"])]
    args += ["--max-side", str(image["max_side"])] if image["max_side"] else []
    args += [] if image["validate"] else ["--no-validate"]
    args += ["--dedup"] if parameters["dedup"] else []
    args += ["--classes", parameters["classes_file"]] if parameters["classes_file"] else []
    args += ["--path-column", parameters["path_column"]]
    args += ["--label-column", parameters["label_column"]] if labelled(parameters) else ["--no-labels"]
    args += ["--root", parameters["root"]] if parameters.get("root") else []
    args += ["--follow-symlinks"] if parameters.get("follow_symlinks") else []
    return shlex.join(display_path(a) for a in args)


def merge_parts(dest: str) -> dict:
    """`vitforge shard merge`: combine the records of every part into dataset.json."""
    store = open_store(dest)
    if not store.exists(PLAN_NAME):
        raise ManifestError(f"{store.url(PLAN_NAME)}: no shard plan; run `vitforge shard` into {dest} first")
    plan = Plan.from_bytes(store.get_bytes(PLAN_NAME))
    manifest = merge(store, plan, command_line(plan.parameters))
    store.finish()
    return manifest


def run(job: ShardJob) -> PartResult:
    store = open_store(job.dest)
    plan = _load_or_make_plan(job, store)
    owned = plan.shard_range(job.part, job.num_parts)
    names = {i: shard_name(job.prefix, i) for i in owned}
    done = set(store.list(RECORDS_DIR))
    todo = [i for i in owned if record_name(names[i]) not in done]
    log.info("part %d/%d owns shards %d..%d: %d done, %d to build (%d inputs, %d shards in all)",
             job.part, job.num_parts, owned.start, owned.stop - 1, len(owned) - len(todo), len(todo),
             plan.inputs, len(plan.shards))
    store.discard_stale_temporaries(set(names.values()))
    _build_shards(job, plan, store, todo, names)
    manifest = None
    if len(set(store.list(RECORDS_DIR))) >= len(plan.shards):
        manifest = merge(store, plan, command_line(plan.parameters))
    store.finish()
    return PartResult(len(todo), len(owned) - len(todo), len(owned), manifest)


def _load_or_make_plan(job: ShardJob, store) -> Plan:
    wanted = fingerprint(job.output_parameters())
    if store.exists(PLAN_NAME):
        plan = Plan.from_bytes(store.get_bytes(PLAN_NAME))
        if plan.fingerprint != wanted:
            changed = sorted(k for k, v in job.output_parameters().items() if plan.parameters.get(k) != v)
            raise UsageError(f"{job.dest} already holds shards made with other parameters "
                             f"({', '.join(changed)} differ); use a new destination")
        return plan
    classes = load_class_names(job.classes_file) if job.classes_file else None
    corpus = list_corpus(job.src, classes=classes, path_column=job.path_column, label_column=job.label_column,
                         root=job.root, labelled=job.labels, follow_symlinks=job.follow_symlinks)
    plan = make_plan(corpus, job.output_parameters(), seed=job.seed, shard_bytes=job.shard_bytes,
                     shard_samples=job.shard_samples, dedup=job.dedup)
    # Every part of a job array computes the same plan, so concurrent writers store identical bytes.
    store.put_bytes(PLAN_NAME, plan.to_bytes())
    return plan


def _build_shards(job: ShardJob, plan: Plan, store, todo: list[int], names: dict[int, str]) -> None:
    items = [item for i in todo for item in plan.shards[i]]
    progress = Progress(len(items), "shard")
    process = functools.partial(_process_item, opts=job.image, classes=tuple(plan.classes))
    # Packing without validation is file reads and hashing, which threads overlap well.
    results = ordered_map(process, items, job.workers, threads=not job.image.validate)
    # One publisher thread syncs and uploads shard N while shard N+1 is packed; at most one waits.
    publisher = ThreadPoolExecutor(1, thread_name_prefix="publish")
    published = None
    try:
        for i in todo:
            staged = _pack_shard(store.temp_path(names[i]), (next(results) for _ in plan.shards[i]), progress)
            if published is not None:
                published.result()
            published = publisher.submit(_publish_shard, store, names[i], staged)
        if published is not None:
            published.result()
    finally:
        results.close()
        publisher.shutdown(wait=True)
        progress.close()


@dataclass
class StagedShard:
    path: str
    writer: TarShardWriter
    record: dict


def _pack_shard(staging: str, results, progress: Progress) -> StagedShard:
    rejects: list[dict] = []
    class_counts: Counter = Counter()
    changes: Counter = Counter()
    histograms = {name: Counter() for name in HISTOGRAMS}
    with _removed_on_error(staging):
        with open(staging, "wb", buffering=1 << 20) as out:
            writer = TarShardWriter(out)
            for result in results:
                if "reject" in result:
                    rejects.append(result["reject"])
                else:
                    writer.write(result["sample"])
                    if result["label"] is not None:
                        class_counts[result["label"]] += 1
                    changes.update(result["changes"])
                    for name, counter in histograms.items():
                        counter[power_of_two_band(result[name])] += 1
                progress.update(1, result.get("bytes", 0))
            writer.close()
    record = {"class_counts": {str(k): v for k, v in sorted(class_counts.items())},
              "normalised": dict(sorted(changes.items())), "rejects": rejects,
              **{name: {str(k): v for k, v in sorted(c.items())} for name, c in histograms.items()}}
    return StagedShard(staging, writer, record)


def _publish_shard(store, name: str, staged: StagedShard) -> None:
    """Tar, then index, then the record: the record is the commit mark, so it goes last."""
    with _removed_on_error(staged.path):
        with open(staged.path, "rb") as f:
            os.fsync(f.fileno())
        store.put_file(staged.path, name)
    index = staged.writer.dali_index()
    store.put_bytes(index_path_for(name), index)
    record = {"name": name, "index": index_path_for(name), "samples": staged.writer.samples,
              "bytes": staged.writer.offset, "sha256": staged.writer.sha256,
              "index_sha256": hashlib.sha256(index).hexdigest(), **staged.record}
    store.put_bytes(record_name(name), json.dumps(record, sort_keys=True, indent=1).encode())


@contextlib.contextmanager
def _removed_on_error(path: str):
    """A staged file that did not make it into place is deleted, not left for a reader to find."""
    try:
        yield
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise


def power_of_two_band(value: int) -> int:
    """The histogram band of a value: the largest power of two not above it (0 for 0)."""
    return 1 << (value.bit_length() - 1) if value > 0 else 0


def _process_item(item: PlanItem, *, opts: ImageOptions, classes: tuple[str, ...]) -> dict:
    """Runs in a worker: read, validate and normalise one input into a sample (or a reject)."""
    shown = display_path(item.source)
    if item.problem:
        return {"reject": {"key": item.key, "source": shown, "reason": item.problem[0], "detail": item.problem[1]}}
    try:
        data = read_source(item.source)
        ext_hint = os.path.splitext(item.source)[1].lower().lstrip(".").replace("jpeg", "jpg") or "jpg"
        encoded = normalise(data, ext_hint, opts)
    except Rejected as e:
        return {"reject": {"key": item.key, "source": shown, "reason": e.reason, "detail": e.detail}}
    except StorageError:
        raise  # the store itself failed (its deadline passed): no image is to blame
    except OSError as e:
        detail = f"{type(e).__name__}: {e.strerror or e}"
        return {"reject": {"key": item.key, "source": shown, "reason": "unreadable", "detail": detail}}
    info = {"source": shown, "sha256": hashlib.sha256(data).hexdigest(), "source_bytes": len(data)}
    if item.label is not None:
        info.update({"label": item.label, "class": classes[item.label]})
    if opts.validate:
        info.update(width=encoded.width, height=encoded.height,
                    source_width=encoded.source_width, source_height=encoded.source_height)
    if encoded.changes:
        info["normalised"] = list(encoded.changes)
    if item.meta:
        info["meta"] = item.meta
    label = {} if item.label is None else {"cls": str(item.label).encode()}
    sample = {"__key__": item.key, encoded.ext: encoded.data, **label,
              "json": json.dumps(info, sort_keys=True).encode()}
    return {"sample": sample, "label": item.label, "changes": encoded.changes, "bytes": len(data),
            "image_bytes": len(encoded.data), "short_side": min(encoded.width, encoded.height)}
