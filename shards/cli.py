"""`vitforge shard ...`: argument parsing and reporting; the work is done in build / verify."""

from __future__ import annotations

import argparse
import logging
import os
import re

from vitforge.core import open_store, scheduler_env, setup_logging
from vitforge.core.cli_args import bounded, non_negative_int, positive_float, positive_int
from vitforge.core.errors import CHECK_FAILED

from .build import PartResult, ShardJob, merge_parts, run
from .download import USER_AGENT, DownloadOptions
from .images import ImageOptions
from .manifest import added
from .optouts import OPT_OUTS
from .retry import retry_settings
from .url_guard import parse_networks
from .verify import info, verify

DESCRIPTION = """\
Pack an image corpus into WebDataset tar shards with DALI index files and a dataset.json manifest.

  vitforge shard SRC DEST [options]      shard a corpus (resumable: rerun the same command after a crash)
  vitforge shard SRC DEST --extend       add SRC to DEST's dataset as a new version (old shards untouched)
  vitforge shard --retry-failed DEST     download a URL-list dataset's retryable failures again (a new version)
  vitforge shard merge DEST              combine the parts of a --num-parts run into dataset.json
  vitforge shard verify DEST             re-read every shard and check it against the manifest
  vitforge shard info DEST               summarise a sharded dataset

SRC is a class-folder tree (SRC/CLASS/IMAGE, as ImageNet's train split) or a CSV / TSV / JSONL /
Parquet manifest with a path column and a label column; DEST is a folder or an s3:// prefix.
With --no-labels, SRC is any folder of images (at any depth) or a manifest with only a path
column, and the samples carry no label: for self-supervised pre-training (masked patch prediction).
With --url-col, SRC is a URL list (CSV / TSV / JSONL / Parquet, as LAION's and DataComp's):
each row's image is downloaded (opt-outs honoured, private addresses refused, retried within a
deadline) and then validated and packed like a local image; failures are rows of rejects.jsonl.
Object-store endpoint and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_PROFILE, AWS_ACCESS_KEY_ID ...)."""
RETRY_DESCRIPTION = """\
Download a URL-list dataset's retryable failures again (timeouts, connection errors, 408, 429,
5xx, robots.txt unavailable: rejects.jsonl's rows with "retryable": true), as a new version of
the dataset (see --extend): each row that now downloads becomes a sample under the key it always
had; the others stay rejects. Rows are fetched with the user agent, opt-outs, allowed networks
and limits they were listed with; only the timing options below may differ. Run it again to
retry what still fails."""
URL_LIST_SHARD_SAMPLES = 10_000  # a URL list has no sizes before downloading: shards close by count

SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
              "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1GiB, 500MB, 100000)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitforge shard", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="class-folder tree or manifest (.csv/.tsv/.jsonl/.parquet), local or URL")
    p.add_argument("dest", help="output folder or s3:// prefix")
    size = p.add_argument_group("shard size (a shard closes at whichever limit comes first)")
    size.add_argument("--shard-bytes", type=parse_size, default=1 << 30,
                      help="target bytes per shard, planned from source sizes (default 1GiB; 0 = no byte limit)")
    size.add_argument("--shard-samples", type=positive_int, default=None, help="at most this many samples per shard")
    order = p.add_argument_group("naming and order")
    order.add_argument("--prefix", default="train", help="shard names are PREFIX-000000.tar (default train)")
    order.add_argument("--seed", type=int, default=0, help="global shuffle seed (default 0)")
    image = p.add_argument_group("images")
    image.add_argument("--format", choices=("keep", "jpeg"), default="keep",
                       help="keep: JPEG/PNG/WebP stay as they are; jpeg: re-encode everything else as JPEG")
    image.add_argument("--quality", type=bounded(int, 1, 100), default=95,
                       help="JPEG quality when re-encoding (default 95)")
    image.add_argument("--max-side", type=positive_int, default=None,
                       help="downscale images whose longer side exceeds N")
    image.add_argument("--min-side", type=positive_int, default=1, help="reject images whose shorter side is under N")
    image.add_argument("--max-pixels", type=positive_int, default=ImageOptions.max_pixels,
                       help=f"reject larger images as decompression bombs (default {ImageOptions.max_pixels})")
    image.add_argument("--no-validate", dest="validate", action="store_false",
                       help="pack bytes as they are, without decoding (only for corpora you already trust)")
    image.add_argument("--dedup", action="store_true", help="drop exact duplicates (same content sha256)")
    labels = p.add_argument_group("labels")
    labels.add_argument("--classes", dest="classes_file", default=None,
                        help="class names: a text file (one per line), a JSON list/dict, or another dataset.json")
    labels.add_argument("--no-labels", dest="labels", action="store_false",
                        help="an unlabelled corpus: every image under SRC, or every manifest row, without a label")
    labels.add_argument("--path-column", default="path", help="manifest column with the image path (default path)")
    labels.add_argument("--label-column", "--label-col", default="label",
                        help="manifest column with the label (default label)")
    labels.add_argument("--image-col", dest="image_column", default=None,
                        help="SRC is a Parquet file in the Hugging Face datasets layout: this column holds "
                             "struct<bytes, path> images (class names from its ClassLabel metadata)")
    labels.add_argument("--root", default=None,
                        help="manifest paths must resolve inside this folder or URL prefix (default: the manifest's "
                             "own folder; --root / allows any local path); rows outside it are rejected")
    labels.add_argument("--follow-symlinks", action="store_true",
                        help="follow symlinked folders below a folder SRC (default: skipped, with a warning); "
                             "only those leading inside SRC, or inside --root when given, and each real folder once")
    _url_arguments(p)
    versions = p.add_argument_group(
        "extending a dataset (each version's manifest stays as dataset.vN.json: a reader or run that names "
        "it keeps reading that set)")
    versions.add_argument("--extend", action="store_true",
                          help="add SRC to the finished dataset in DEST as a new version: new shards numbered on, "
                               "class ids kept (new classes appended), exact duplicates of anything already in "
                               "it (or in SRC) left out; image settings and --prefix must be the dataset's")
    versions.add_argument("--verify-existing", action="store_true",
                          help="with --extend: re-read every existing shard against its checksum first "
                               "(default: the manifest's checksums are trusted)")
    _execution_arguments(p)
    return p


def _url_arguments(p: argparse.ArgumentParser) -> None:
    d = DownloadOptions()
    urls = p.add_argument_group("URL lists (SRC a manifest of http(s) URLs; shards close at "
                                f"{URL_LIST_SHARD_SAMPLES} samples unless --shard-samples says otherwise)")
    urls.add_argument("--url-col", dest="url_column", default=None,
                      help="the column holding each row's image URL: makes SRC a URL list to download")
    urls.add_argument("--caption-col", dest="caption_column", default=None,
                      help="a caption column: each sample's .txt member (and kept in its JSON)")
    urls.add_argument("--meta-col", dest="meta_columns", action="append", default=None, metavar="COL",
                      help="a column kept in each sample's JSON (repeatable; default: every column)")
    _timing_arguments(urls)
    urls.add_argument("--max-body", type=parse_size, default=d.max_bytes, metavar="SIZE",
                      help=f"refuse larger downloads (default {d.max_bytes >> 20}MiB)")
    urls.add_argument("--max-redirects", type=non_negative_int, default=d.max_redirects,
                      help=f"default {d.max_redirects}; a redirect loop fails at once")
    urls.add_argument("--user-agent", default=USER_AGENT, help="names the project and a contact by default")
    urls.add_argument("--ignore-opt-out", dest="ignore_opt_outs", action="append", default=[], choices=OPT_OUTS,
                      help="do not honour this opt-out (robots.txt or x-robots-tag); by name, one at a time")
    urls.add_argument("--allow-network", dest="allow_networks", action="append", default=[], metavar="CIDR",
                      help="let downloads reach this network although it is loopback, private or link-local "
                           "(refused by default: a crawled list must not reach a node's metadata endpoint)")


def _timing_arguments(group) -> None:
    """How fast and how patiently URLs are downloaded: never what a success holds."""
    d = DownloadOptions()
    group.add_argument("--concurrency", type=positive_int, default=d.concurrency,
                       help=f"downloads in flight (default {d.concurrency}); the output is the same for any value")
    group.add_argument("--per-host", type=positive_int, default=d.per_host,
                       help=f"connections per host (default {d.per_host})")
    group.add_argument("--host-rate", type=float, default=d.host_rate, metavar="PER_SECOND",
                       help="request starts per second per host (default 0: unlimited)")
    group.add_argument("--connect-timeout", type=positive_float, default=d.connect_timeout, metavar="SECONDS",
                       help=f"default {d.connect_timeout:g}")
    group.add_argument("--first-byte-timeout", type=positive_float, default=d.first_byte_timeout, metavar="SECONDS",
                       help=f"until the response's headers, and between reads of its body (default "
                            f"{d.first_byte_timeout:g})")
    group.add_argument("--deadline", type=positive_float, default=d.deadline, metavar="SECONDS",
                       help=f"one URL's whole download: redirects, retries and body; waiting for the host's "
                            f"turn does not count (default {d.deadline:g})")
    group.add_argument("--retries", type=non_negative_int, default=d.retries,
                       help=f"retries of connection errors, timeouts, 408, 429 and 5xx (default {d.retries}); "
                            "Retry-After is honoured, other 4xx are never retried")


def _execution_arguments(p: argparse.ArgumentParser) -> None:
    run_group = p.add_argument_group("execution")
    run_group.add_argument("--workers", type=positive_int, default=default_workers(),
                           help="decode/validate processes (default: CPUs available); output is the same for any N")
    run_group.add_argument("--num-parts", type=positive_int, default=1,
                           help="split the shards into P parts (one per job-array task); merge afterwards")
    run_group.add_argument("--part", type=non_negative_int, default=None,
                           help="which part this process builds "
                                "(default: $SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN)")
    run_group.add_argument("--plan-wait", type=positive_float, default=24 * 3600, metavar="SECONDS",
                           help="one task of a job lists and plans while the others wait for its plan; give up "
                                "waiting after this long (default 86400); a planner that died is taken over")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def _retry_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitforge shard --retry-failed", description=RETRY_DESCRIPTION)
    p.add_argument("dest", help="the folder or store prefix holding a URL-list dataset's dataset.json")
    p.add_argument("--shard-samples", type=positive_int, default=URL_LIST_SHARD_SAMPLES,
                   help=f"at most this many samples per new shard (default {URL_LIST_SHARD_SAMPLES})")
    _timing_arguments(p.add_argument_group("downloading"))
    _execution_arguments(p)
    return p


def _subcommand_parser(name: str, help_text: str, workers: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"vitforge shard {name}", description=help_text)
    p.add_argument("dest", help="the folder or s3:// prefix holding dataset.json")
    if workers:
        p.add_argument("--workers", type=positive_int, default=default_workers(), help="shards checked in parallel")
    return p


def _part_from_env() -> int:
    """This job-array task's place in its array (part 0 outside one)."""
    index = scheduler_env().array_index
    return 0 if index is None else index


def main(argv: list[str]) -> int:
    setup_logging()
    if argv and argv[0] == "merge":
        args = _subcommand_parser("merge", "Combine the parts' records into dataset.json.").parse_args(argv[1:])
        print(_summary(merge_parts(args.dest), args.dest))
        return 0
    if argv and argv[0] == "verify":
        args = _subcommand_parser("verify", "Check every shard against dataset.json.", True).parse_args(argv[1:])
        manifest, problems = verify(args.dest, args.workers)
        for problem in problems:
            print(f"PROBLEM {problem}")
        print(f"verified {len(manifest['shards'])} shards, {manifest['totals']['samples']} samples: "
              + (f"{len(problems)} problems" if problems else "all good"))
        return CHECK_FAILED if problems else 0
    if "--retry-failed" in argv:
        return _retry([a for a in argv if a != "--retry-failed"])
    if argv and argv[0] == "info":
        print(info(_subcommand_parser("info", "Summarise a sharded dataset.").parse_args(argv[1:]).dest))
        return 0
    return _shard(build_parser().parse_args(argv))


def _timing(args: argparse.Namespace, **output) -> DownloadOptions:
    return DownloadOptions(concurrency=args.concurrency, per_host=args.per_host, host_rate=args.host_rate,
                           connect_timeout=args.connect_timeout, first_byte_timeout=args.first_byte_timeout,
                           deadline=args.deadline, retries=args.retries, **output)


def _retry(argv: list[str]) -> int:
    args = _retry_parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    job = ShardJob(dest=args.dest, **retry_settings(open_store(args.dest), args.dest, _timing(args)),
                   shard_samples=args.shard_samples, workers=args.workers, num_parts=args.num_parts,
                   part=_part_from_env() if args.part is None else args.part, plan_wait_s=args.plan_wait)
    return _report(job, run(job), args.dest)


def _shard(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level)
    download = _timing(args, max_redirects=args.max_redirects, max_bytes=args.max_body, user_agent=args.user_agent,
                       ignore_opt_outs=tuple(sorted(set(args.ignore_opt_outs))),
                       allow_networks=parse_networks(args.allow_networks))
    shard_samples = args.shard_samples or (URL_LIST_SHARD_SAMPLES if args.url_column else None)
    job = ShardJob(
        src=args.src, dest=args.dest, prefix=args.prefix, seed=args.seed, shard_bytes=args.shard_bytes or None,
        shard_samples=shard_samples, url_column=args.url_column, caption_column=args.caption_column,
        meta_columns=_kept_columns(args), download=download, image_column=args.image_column,
        image=ImageOptions(format=args.format, quality=args.quality, max_side=args.max_side,
                           min_side=args.min_side, max_pixels=args.max_pixels, validate=args.validate),
        dedup=args.dedup, classes_file=args.classes_file, path_column=args.path_column,
        label_column=args.label_column, root=args.root, labels=args.labels,
        follow_symlinks=args.follow_symlinks, workers=args.workers,
        num_parts=args.num_parts, part=_part_from_env() if args.part is None else args.part,
        plan_wait_s=args.plan_wait, extend=args.extend, verify_existing=args.verify_existing,
    )
    return _report(job, run(job), args.dest)


def _report(job: ShardJob, result: PartResult, dest: str) -> int:
    print(f"part {job.part + 1} of {job.num_parts}: built {result.shards_built} shards, "
          f"{result.shards_skipped} already complete")
    if result.manifest is None:
        print(f"other parts are still running; when all are done: vitforge shard merge {dest}")
        return 0
    print(_summary(result.manifest, dest))
    return 0


def _kept_columns(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--meta-col's columns, the caption column among them (it goes in the JSON too)."""
    if args.meta_columns is None:
        return None
    extra = [args.caption_column] if args.caption_column and args.caption_column not in args.meta_columns else []
    return tuple(args.meta_columns + extra)


def _classes(manifest: dict) -> str:
    return "unlabelled" if manifest["num_classes"] is None else f"{manifest['num_classes']} classes"


def _summary(manifest: dict, dest: str) -> str:
    t = manifest["totals"]
    lines = [f"{t['inputs']} inputs = {t['samples']} packed + {t['rejected']} rejected + {t['duplicates']} duplicates",
             f"{t['shards']} shards, {t['bytes']} bytes, {_classes(manifest)} -> {dest}"]
    if manifest.get("version", 1) > 1:
        version = manifest["version"]
        lines.append(f"version {version} (dataset.v{version}.json) {added(manifest['history'][-1])}")
    if manifest["rejects_by_reason"]:
        reasons = ", ".join(f"{k} {v}" for k, v in manifest["rejects_by_reason"].items())
        lines.append(f"rejected: {reasons} (details in rejects.jsonl)")
    if manifest.get("rejects_by_host"):
        lines.append("failures by host (most first):")
        lines += [f"  {host:<40} {sum(reasons.values()):>8}  " + ", ".join(f"{k} {v}" for k, v in reasons.items())
                  for host, reasons in manifest["rejects_by_host"].items()]
    if manifest["normalised"]:
        lines.append("normalised: " + ", ".join(f"{k} {v}" for k, v in manifest["normalised"].items()))
    return "\n".join(lines)
