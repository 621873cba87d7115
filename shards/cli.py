"""`vitforge shard ...`: runs what its command lines ask (cli_parser.py parses them) and reports
the result; the work is done in build / verify."""

from __future__ import annotations

import argparse
import logging

from vitforge.core import open_store, scheduler_env, setup_logging
from vitforge.core.errors import CHECK_FAILED

from .build import PartResult, ShardJob, merge_parts, run
from .cli_parser import URL_LIST_SHARD_SAMPLES, build_parser, retry_parser, subcommand_parser
from .download import DownloadOptions
from .images import ImageOptions
from .manifest import added
from .retry import retry_settings
from .url_guard import parse_networks
from .verify import info, verify


def _part_from_env() -> int:
    """This job-array task's place in its array (part 0 outside one)."""
    index = scheduler_env().array_index
    return 0 if index is None else index


def main(argv: list[str]) -> int:
    setup_logging()
    if argv and argv[0] == "merge":
        args = subcommand_parser("merge", "Combine the parts' records into dataset.json.").parse_args(argv[1:])
        print(_summary(merge_parts(args.dest), args.dest))
        return 0
    if argv and argv[0] == "verify":
        args = subcommand_parser("verify", "Check every shard against dataset.json.", True).parse_args(argv[1:])
        manifest, problems = verify(args.dest, args.workers)
        for problem in problems:
            print(f"PROBLEM {problem}")
        print(
            f"verified {len(manifest['shards'])} shards, {manifest['totals']['samples']} samples: "
            + (f"{len(problems)} problems" if problems else "all good")
        )
        return CHECK_FAILED if problems else 0
    if "--retry-failed" in argv:
        return _retry([a for a in argv if a != "--retry-failed"])
    if argv and argv[0] == "info":
        print(info(subcommand_parser("info", "Summarise a sharded dataset.").parse_args(argv[1:]).dest))
        return 0
    return _shard(build_parser().parse_args(argv))


def _timing(args: argparse.Namespace, **output) -> DownloadOptions:
    return DownloadOptions(
        concurrency=args.concurrency,
        per_host=args.per_host,
        host_rate=args.host_rate,
        connect_timeout=args.connect_timeout,
        first_byte_timeout=args.first_byte_timeout,
        deadline=args.deadline,
        retries=args.retries,
        **output,
    )


def _retry(argv: list[str]) -> int:
    args = retry_parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    job = ShardJob(
        dest=args.dest,
        **retry_settings(open_store(args.dest), args.dest, _timing(args)),
        shard_samples=args.shard_samples,
        workers=args.workers,
        num_parts=args.num_parts,
        part=_part_from_env() if args.part is None else args.part,
        plan_wait_s=args.plan_wait,
    )
    return _report(job, run(job), args.dest)


def _shard(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level)
    download = _timing(
        args,
        max_redirects=args.max_redirects,
        max_bytes=args.max_body,
        user_agent=args.user_agent,
        ignore_opt_outs=tuple(sorted(set(args.ignore_opt_outs))),
        allow_networks=parse_networks(args.allow_networks),
    )
    shard_samples = args.shard_samples or (URL_LIST_SHARD_SAMPLES if args.url_column else None)
    job = ShardJob(
        src=args.src,
        dest=args.dest,
        prefix=args.prefix,
        seed=args.seed,
        shard_bytes=args.shard_bytes or None,
        shard_samples=shard_samples,
        url_column=args.url_column,
        caption_column=args.caption_column,
        meta_columns=_kept_columns(args),
        download=download,
        image_column=args.image_column,
        image=ImageOptions(
            format=args.format,
            quality=args.quality,
            max_side=args.max_side,
            min_side=args.min_side,
            max_pixels=args.max_pixels,
            validate=args.validate,
        ),
        dedup=args.dedup,
        classes_file=args.classes_file,
        path_column=args.path_column,
        label_column=args.label_column,
        root=args.root,
        labels=args.labels,
        follow_symlinks=args.follow_symlinks,
        workers=args.workers,
        num_parts=args.num_parts,
        part=_part_from_env() if args.part is None else args.part,
        plan_wait_s=args.plan_wait,
        extend=args.extend,
        verify_existing=args.verify_existing,
    )
    return _report(job, run(job), args.dest)


def _report(job: ShardJob, result: PartResult, dest: str) -> int:
    print(
        f"part {job.part + 1} of {job.num_parts}: built {result.shards_built} shards, "
        f"{result.shards_skipped} already complete"
    )
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
    lines = [
        f"{t['inputs']} inputs = {t['samples']} packed + {t['rejected']} rejected + {t['duplicates']} duplicates",
        f"{t['shards']} shards, {t['bytes']} bytes, {_classes(manifest)} -> {dest}",
    ]
    if manifest.get("version", 1) > 1:
        version = manifest["version"]
        lines.append(f"version {version} (dataset.v{version}.json) {added(manifest['history'][-1])}")
    if manifest["rejects_by_reason"]:
        reasons = ", ".join(f"{k} {v}" for k, v in manifest["rejects_by_reason"].items())
        lines.append(f"rejected: {reasons} (details in rejects.jsonl)")
    if manifest.get("rejects_by_host"):
        lines.append("failures by host (most first):")
        lines += [
            f"  {host:<40} {sum(reasons.values()):>8}  " + ", ".join(f"{k} {v}" for k, v in reasons.items())
            for host, reasons in manifest["rejects_by_host"].items()
        ]
    if manifest["normalised"]:
        lines.append("normalised: " + ", ".join(f"{k} {v}" for k, v in manifest["normalised"].items()))
    return "\n".join(lines)
