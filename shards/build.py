"""The sharder's main loop: plan (one task per job), then pack each shard this part owns, then merge.

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
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from vitforge.core import Progress, UsageError, create_file, open_store

from .array_plan import plan_across_array, spreads
from .claims import made_once
from .download import Downloader, DownloadOptions
from .extend import Extension, existing_digests, open_extension
from .hf_parquet import EmbeddedImages, embedded_row, row_reader
from .images import ImageOptions
from .layout import FIRST, MANIFEST_NAME, Work, shard_name
from .manifest import HISTOGRAMS, ManifestError, command_line, history_of, merge, read_manifest, version_of
from .parallel import ordered_map
from .plan import Inputs, fingerprint, plan_inputs, write_plan
from .plan_slices import PlanHeader, PlanItem, load_slice, read_header
from .retry import write_retry_plan
from .samples import to_sample
from .sources import Corpus, list_corpus, load_class_names, read_source
from .tarfile_writer import TarShardWriter, index_path_for
from .verify import verify

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
    plan_wait_s: float = 24 * 3600  # how long a task waits for another task's plan
    url_column: str | None = None  # SRC is a URL list: this manifest column holds the http(s) URLs to download
    caption_column: str | None = None  # a URL list's caption: the sample's .txt member
    meta_columns: tuple[str, ...] | None = None  # the manifest columns kept in each sample's JSON (default all)
    download: DownloadOptions = field(default_factory=DownloadOptions)
    image_column: str | None = None  # SRC is a datasets Parquet file with its images in this column
    extend: bool = False  # add SRC to DEST's finished dataset as a new version
    verify_existing: bool = False  # with extend: re-read the dataset's shards first, not trust their checksums
    retry_of: int | None = None  # download the retryable rejects of this version of DEST again (an extension)

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
        if not self.plan_wait_s > 0:
            raise UsageError(f"--plan-wait must be > 0 seconds, not {self.plan_wait_s}")
        if self.caption_column and not self.url_column:
            raise UsageError("--caption-col describes a URL list: give --url-col too")
        if self.meta_columns is not None and not (self.url_column or self.image_column):
            raise UsageError("--meta-col needs --url-col or --image-col")
        if self.url_column and self.image_column:
            raise UsageError("--url-col and --image-col contradict each other: a file holds URLs or images")
        if self.verify_existing and not self.extend:
            raise UsageError("--verify-existing checks the dataset an --extend adds to: give --extend too")

    def output_parameters(self) -> dict:
        """Everything that shapes the output bytes, and nothing else (not workers, not part)."""
        return {
            "src": self.src,
            "prefix": self.prefix,
            "seed": self.seed,
            "shard_bytes": self.shard_bytes,
            "shard_samples": self.shard_samples,
            "image": asdict(self.image),
            "dedup": self.dedup or self.extend,
            "classes_file": self.classes_file,
            "path_column": self.path_column,
            "label_column": self.label_column,
            "root": self.root,
            "labels": self.labels,
            # Only when set, so datasets sharded before the option existed keep their fingerprint.
            **({"follow_symlinks": True} if self.follow_symlinks else {}),
            **(self._url_parameters() if self.url_column else {}),
            **({"image_column": self.image_column} if self.image_column else {}),
            **(
                {"meta_columns": list(self.meta_columns) if self.meta_columns is not None else None}
                if self.url_column or self.image_column
                else {}
            ),
            **({"extend": True} if self.extend else {}),
            **({"retry_of": self.retry_of} if self.retry_of is not None else {}),
        }

    def _url_parameters(self) -> dict:
        """A URL list's settings that decide which rows become samples (not timeouts or concurrency:
        those change how fast, and which rows fail transiently, not what a success holds)."""
        d = self.download
        return {
            "url_column": self.url_column,
            "caption_column": self.caption_column,
            "download": {
                "max_bytes": d.max_bytes,
                "max_redirects": d.max_redirects,
                "ignore_opt_outs": sorted(d.ignore_opt_outs),
                "allow_networks": [str(n) for n in d.allow_networks],
                "user_agent": d.user_agent,
            },
        }


@dataclass
class PartResult:
    shards_built: int
    shards_skipped: int
    shards_owned: int
    manifest: dict | None  # the dataset manifest, once every part is done


def merge_parts(dest: str) -> dict:
    """`vitforge shard merge`: combine the records of every part into dataset.json (of the
    extension under way, when the latest version has one)."""
    store = open_store(dest)
    base = read_manifest(store) if store.exists(MANIFEST_NAME) else None
    work = Work.of(version_of(base) + 1) if base else FIRST
    header = read_header(store, work)
    if header is None and base is not None:
        return base  # finished: no extension under way
    if header is None:
        raise ManifestError(f"{store.url(work.header)}: no shard plan; run `vitforge shard` into {dest} first")
    manifest = merge(store, header, command_line(header.parameters), work=work, base=base)
    store.finish()
    return manifest


def run(job: ShardJob) -> PartResult:
    store = open_store(job.dest)
    extension = _extension(job, store) if job.extend else None
    if extension is not None and extension.done:
        log.info("%s: this extension is its version %d already", job.dest, extension.version - 1)
        return PartResult(0, 0, 0, extension.base)
    work = extension.work if extension else FIRST
    header = ensure_plan(job, store, extension)
    owned = header.shard_range(job.part, job.num_parts)
    names = {i: shard_name(job.prefix, i) for i in owned}
    done = set(store.list(work.records_dir))
    todo = [i for i in owned if work.record(names[i]) not in done]
    log.info(
        "part %d/%d owns shards %d..%d: %d done, %d to build (%d inputs, %d shards in all)",
        job.part,
        job.num_parts,
        owned.start,
        owned.stop - 1,
        len(owned) - len(todo),
        len(todo),
        header.inputs,
        header.shards,
    )
    store.discard_stale_temporaries(set(names.values()))
    if todo:
        shards = load_slice(store, header, job.part, job.num_parts, work)
        _build_shards(job, [shards[i] for i in todo], tuple(header.classes), store, [names[i] for i in todo], work)
    manifest = None
    if len(set(store.list(work.records_dir))) >= header.shards:
        manifest = _merged(store, header) or merge(
            store, header, command_line(header.parameters), work=work, base=extension.base if extension else None
        )
    store.finish()
    return PartResult(len(todo), len(owned) - len(todo), len(owned), manifest)


def _merged(store, header: PlanHeader) -> dict | None:
    """dataset.json, when it holds this plan's version already: a late task of a finished job
    merges nothing (merging version 1 again would hide the versions added since)."""
    if not store.exists(MANIFEST_NAME):
        return None
    manifest = read_manifest(store)
    return manifest if any(h["plan_fingerprint"] == header.fingerprint for h in history_of(manifest)) else None


def _extension(job: ShardJob, store) -> Extension:
    return open_extension(store, job.dest, job.output_parameters(), fingerprint(job.output_parameters()))


def ensure_plan(job: ShardJob, store=None, extension: Extension | None = None) -> PlanHeader:
    """The plan's header: read, or made by this task when no other task of the job is making it
    (the submit step may call this first, so that no array task lists the corpus). One task plans
    while the others wait for the header (shards/claims.py), unless the job spreads its planning
    over every task of the array (shards/array_plan.py: a Parquet list split by row group)."""
    store = store or open_store(job.dest)
    if job.extend and extension is None:
        extension = _extension(job, store)
    work = extension.work if extension else FIRST
    if store.exists(work.legacy_plan) and read_header(store, work) is None:
        raise UsageError(
            f"{job.dest} was started by an older vitforge (it holds {work.legacy_plan}): finish it "
            "with that version, or shard into a new destination"
        )
    if extension is None and spreads(job):
        header = plan_across_array(job, store, work)
    else:
        header = made_once(
            store,
            work.claim,
            lambda: read_header(store, work),
            lambda: _make_plan(job, store, extension),
            job.part,
            "the shard plan",
            job.plan_wait_s,
        )
    return _checked(job, header, work)


def _checked(job: ShardJob, header: PlanHeader, work: Work) -> PlanHeader:
    parameters = job.output_parameters()
    if header.fingerprint != fingerprint(parameters) and work != FIRST:
        raise UsageError(
            f"{job.dest} has an unfinished extension, planned in {work.root}/ by "
            f"`{command_line(header.parameters)}`: finish it by running that command again, or abandon "
            f"it by deleting {work.root}/ (the next extension writes its shard numbers anew)"
        )
    if header.fingerprint != fingerprint(parameters):
        changed = sorted(k for k, v in parameters.items() if header.parameters.get(k) != v)
        hint = "" if job.extend else ", or --extend to add SRC to a finished dataset as a new version"
        raise UsageError(
            f"{job.dest} already holds shards made with other parameters "
            f"({', '.join(changed)} differ); use a new destination{hint}"
        )
    return header


def _make_plan(job: ShardJob, store, extension: Extension | None) -> PlanHeader:
    started = time.monotonic()
    if extension is not None:
        if job.verify_existing:
            _, problems = verify(job.dest, job.workers)
            if problems:
                raise UsageError(
                    f"{job.dest}: the dataset to extend fails verification ({len(problems)} problems), "
                    f"first: {problems[0]}"
                )
        extension.snapshot(store)
    if job.retry_of is not None:
        header = write_retry_plan(store, extension, job.output_parameters(), job.shard_samples)
        log.info("planned %d retryable rejects into %d shards", header.retried, header.shards)
        return header
    corpus = _listed(job)
    inputs = Inputs.of(corpus.records, job.seed)  # records stream into the columns, none is kept
    classes, existing, first = corpus.classes, None, (0, 0)
    if extension is not None:
        classes = extension.classes(corpus.classes, inputs.labels)
        existing = existing_digests(store, extension.base, bool(job.url_column), job.workers)
        first = (extension.first_shard, extension.first_position)
    with contextlib.ExitStack() as stack:
        # A URL list is deduplicated by URL before anything is downloaded; its images' contents are
        # known only once fetched. A Parquet file's embedded images are read in a pass of their own.
        read = (lambda url: url.encode()) if job.url_column else read_source
        if (job.dedup or job.extend) and job.image_column:
            read = stack.enter_context(row_reader(job.src, job.image_column, read_source))
        plan = plan_inputs(
            inputs,
            classes,
            job.output_parameters(),
            shard_bytes=job.shard_bytes,
            shard_samples=job.shard_samples,
            dedup=job.dedup or job.extend,
            read=read,
            existing=existing,
            first_shard=first[0],
            first_position=first[1],
        )
    header = write_plan(store, plan, job.num_parts, work=extension.work if extension else FIRST)
    log.info(
        "planned %d inputs into %d shards in %d slices (%.1f s)",
        header.inputs,
        header.shards,
        header.parts,
        time.monotonic() - started,
    )
    return header


def _listed(job: ShardJob) -> Corpus:
    """SRC's listing as the job reads it: its class names, columns, root, labels and symlinks."""
    classes = load_class_names(job.classes_file) if job.classes_file else None
    return list_corpus(
        job.src,
        classes=classes,
        path_column=job.url_column or job.path_column,
        label_column=job.label_column,
        root=job.root,
        labelled=job.labels,
        follow_symlinks=job.follow_symlinks,
        url_list=bool(job.url_column),
        meta_columns=job.meta_columns,
        image_column=job.image_column,
    )


def _build_shards(
    job: ShardJob, shards: list[list[PlanItem]], classes: tuple[str, ...], store, names: list[str], work: Work
) -> None:
    items = [item for shard in shards for item in shard]
    progress = Progress(len(items), "shard")
    process = functools.partial(to_sample, opts=job.image, classes=classes, caption=job.caption_column, src=job.src)
    embedded = EmbeddedImages(job.src, job.image_column) if job.image_column else None
    if job.url_column:
        inputs = _downloaded(items, job.download)
    elif embedded is not None:
        # Read here, in plan order (a window of row groups at a time), not in the workers: each would
        # read whole row groups for the few rows it gets.
        inputs = (
            (item, None if embedded_row(item.source) is None else embedded.read(embedded_row(item.source)))
            for item in items
        )
    else:
        inputs = ((item, None) for item in items)
    # Packing without validation is file reads and hashing, which threads overlap well.
    results = ordered_map(process, inputs, job.workers, threads=not job.image.validate)
    # One publisher thread syncs and uploads shard N while shard N+1 is packed; at most one waits.
    publisher = ThreadPoolExecutor(1, thread_name_prefix="publish")
    published = None
    try:
        for name, shard in zip(names, shards):
            staged = _pack_shard(store.temp_path(name), (next(results) for _ in shard), progress)
            if published is not None:
                published.result()
            published = publisher.submit(_publish_shard, store, name, staged, work)
        if published is not None:
            published.result()
    finally:
        results.close()
        publisher.shutdown(wait=True)
        progress.close()
        if job.url_column:
            inputs.close()
        if embedded is not None:
            embedded.close()


def _downloaded(items: list[PlanItem], options: DownloadOptions):
    """Each item with its download. The downloader's thread starts at the first item, once
    ordered_map has forked its workers (a fork copies no thread, but every lock one holds)."""
    with Downloader(options) as downloader:
        yield from zip(items, downloader.fetch_ordered(None if item.problem else item.source for item in items))


@dataclass
class StagedShard:
    path: str
    writer: TarShardWriter
    record: dict


def _pack_shard(staging: str, results, progress: Progress) -> StagedShard:
    rejects: list[dict] = []
    class_counts: Counter = Counter()
    changes: Counter = Counter()
    histograms: dict[str, Counter] = {name: Counter() for name in HISTOGRAMS}
    with _removed_on_error(staging), create_file(staging, buffering=1 << 20) as out, TarShardWriter(out) as writer:
        for result in results:
            if "reject" in result:
                rejects.append(result["reject"])
                progress.count(result["reject"]["reason"])
            else:
                writer.write(result["sample"])
                if result["label"] is not None:
                    class_counts[result["label"]] += 1
                changes.update(result["changes"])
                for name, counter in histograms.items():
                    counter[power_of_two_band(result[name])] += 1
            progress.update(1, result.get("bytes", 0))
        writer.close()
    record = {
        "class_counts": {str(k): v for k, v in sorted(class_counts.items())},
        "normalised": dict(sorted(changes.items())),
        "rejects": rejects,
        **{name: {str(k): v for k, v in sorted(c.items())} for name, c in histograms.items()},
    }
    return StagedShard(staging, writer, record)


def _publish_shard(store, name: str, staged: StagedShard, work: Work) -> None:
    """Tar, then index, then the record: the record is the commit mark, so it goes last."""
    with _removed_on_error(staged.path):
        with open(staged.path, "rb") as f:
            os.fsync(f.fileno())
        store.put_file(staged.path, name)
    index = staged.writer.dali_index()
    store.put_bytes(index_path_for(name), index)
    record = {
        "name": name,
        "index": index_path_for(name),
        "samples": staged.writer.samples,
        "bytes": staged.writer.offset,
        "sha256": staged.writer.sha256,
        "index_sha256": hashlib.sha256(index).hexdigest(),
        **staged.record,
    }
    store.put_bytes(work.record(name), json.dumps(record, sort_keys=True, indent=1).encode())


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
