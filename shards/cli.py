"""`vitforge shard ...`: argument parsing and reporting; the work is done in build / verify."""

from __future__ import annotations

import argparse
import logging
import os
import re

from vitforge.core import scheduler_env, setup_logging
from vitforge.core.cli_args import bounded, non_negative_int, positive_float, positive_int
from vitforge.core.errors import CHECK_FAILED

from .build import ShardJob, merge_parts, run
from .images import ImageOptions
from .verify import info, verify

DESCRIPTION = """\
Pack an image corpus into WebDataset tar shards with DALI index files and a dataset.json manifest.

  vitforge shard SRC DEST [options]      shard a corpus (resumable: rerun the same command after a crash)
  vitforge shard merge DEST              combine the parts of a --num-parts run into dataset.json
  vitforge shard verify DEST             re-read every shard and check it against the manifest
  vitforge shard info DEST               summarise a sharded dataset

SRC is a class-folder tree (SRC/CLASS/IMAGE, as ImageNet's train split) or a CSV / TSV / JSONL /
Parquet manifest with a path column and a label column; DEST is a folder or an s3:// prefix.
With --no-labels, SRC is any folder of images (at any depth) or a manifest with only a path
column, and the samples carry no label: for self-supervised pre-training (masked patch prediction).
Object-store endpoint and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_PROFILE, AWS_ACCESS_KEY_ID ...)."""

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
    labels.add_argument("--label-column", default="label", help="manifest column with the label (default label)")
    labels.add_argument("--root", default=None,
                        help="manifest paths must resolve inside this folder or URL prefix (default: the manifest's "
                             "own folder; --root / allows any local path); rows outside it are rejected")
    labels.add_argument("--follow-symlinks", action="store_true",
                        help="follow symlinked folders below a folder SRC (default: skipped, with a warning); "
                             "only those leading inside SRC, or inside --root when given, and each real folder once")
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
    if argv and argv[0] == "info":
        print(info(_subcommand_parser("info", "Summarise a sharded dataset.").parse_args(argv[1:]).dest))
        return 0
    return _shard(build_parser().parse_args(argv))


def _shard(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level)
    job = ShardJob(
        src=args.src, dest=args.dest, prefix=args.prefix, seed=args.seed, shard_bytes=args.shard_bytes or None,
        shard_samples=args.shard_samples,
        image=ImageOptions(format=args.format, quality=args.quality, max_side=args.max_side,
                           min_side=args.min_side, max_pixels=args.max_pixels, validate=args.validate),
        dedup=args.dedup, classes_file=args.classes_file, path_column=args.path_column,
        label_column=args.label_column, root=args.root, labels=args.labels,
        follow_symlinks=args.follow_symlinks, workers=args.workers,
        num_parts=args.num_parts, part=_part_from_env() if args.part is None else args.part,
        plan_wait_s=args.plan_wait,
    )
    result = run(job)
    print(f"part {job.part + 1} of {job.num_parts}: built {result.shards_built} shards, "
          f"{result.shards_skipped} already complete")
    if result.manifest is None:
        print(f"other parts are still running; when all are done: vitforge shard merge {args.dest}")
        return 0
    print(_summary(result.manifest, args.dest))
    return 0


def _classes(manifest: dict) -> str:
    return "unlabelled" if manifest["num_classes"] is None else f"{manifest['num_classes']} classes"


def _summary(manifest: dict, dest: str) -> str:
    t = manifest["totals"]
    lines = [f"{t['inputs']} inputs = {t['samples']} packed + {t['rejected']} rejected + {t['duplicates']} duplicates",
             f"{t['shards']} shards, {t['bytes']} bytes, {_classes(manifest)} -> {dest}"]
    if manifest["rejects_by_reason"]:
        reasons = ", ".join(f"{k} {v}" for k, v in manifest["rejects_by_reason"].items())
        lines.append(f"rejected: {reasons} (details in rejects.jsonl)")
    if manifest["normalised"]:
        lines.append("normalised: " + ", ".join(f"{k} {v}" for k, v in manifest["normalised"].items()))
    return "\n".join(lines)
