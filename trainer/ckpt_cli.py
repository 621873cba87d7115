"""`vitforge ckpt list|verify|export`: inspect, check and export a run's checkpoints (local or s3://).

vitforge ckpt list RUN                      every checkpoint: step, complete or not (a manifest, and
                                            every file it lists present at its size), size, world size
vitforge ckpt verify RUN[/step_N]           sizes and sha256 of every file against the manifest
vitforge ckpt export RUN[/step_N] --out F   consolidated fp32 weights (any ZeRO stage) as F.safetensors,
                                            with timm key names, plus F.json (model, image size, classes,
                                            objective). RUN: its newest usable checkpoint, as train
                                            resumes. Masked patch prediction exports the encoder
                                            (num_classes=0); --include-head adds F.head.safetensors
"""

from __future__ import annotations

import argparse
import json
import tempfile

from vitforge.core import errors, setup_logging

from .run_store import MANIFEST, RunStore, split_checkpoint_url, step_of


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vitforge ckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list a run's checkpoints").add_argument("run", help="DIR/RUN (local or s3://)")
    verify = sub.add_parser("verify", help="check sizes and checksums against the manifest")
    verify.add_argument("target", help="DIR/RUN (every complete checkpoint) or DIR/RUN/step_N")
    exporter = sub.add_parser("export", help="consolidated fp32 weights as safetensors, for timm")
    exporter.add_argument(
        "target",
        help="DIR/RUN (its newest usable checkpoint: damaged ones are passed over with a "
        "warning) or DIR/RUN/step_N (that one only)",
    )
    exporter.add_argument("--out", required=True, help="output file, ending in .safetensors")
    exporter.add_argument(
        "--include-head",
        action="store_true",
        help="also write the objective's pre-training head (masked patch prediction: [mask] "
        "embedding and colour head) to OUT.head.safetensors, named in OUT.json",
    )
    args = p.parse_args(argv)
    setup_logging()
    if args.command == "list":
        return _list(args.run)
    if args.command == "verify":
        return _verify(args.target)
    from .export import export  # torch and DeepSpeed: seconds that list and verify need not pay

    with tempfile.TemporaryDirectory(prefix="vitforge-export-") as scratch:
        description = export(args.target, args.out, scratch, include_head=args.include_head)
    print(json.dumps({"out": args.out, **description}, sort_keys=True))
    return 0


def _list(url: str) -> int:
    run = RunStore(url)
    latest = run.latest()
    folders = run.step_folders()
    if not folders:
        print(f"{run.url}: no checkpoints")
        return 0
    print(f"{'step':>10}  {'state':<10} {'bytes':>14} {'files':>5} {'ranks':>5}  tag")
    for tag, files in folders.items():
        problems, world = _problems(run, tag, files)
        mark = " <- latest" if tag == latest else ""
        why = f"  ({problems[0]}{f'; {len(problems) - 1} more' if len(problems) > 1 else ''})" if problems else ""
        print(
            f"{step_of(tag):>10}  {'incomplete' if problems else 'complete':<10} {sum(files.values()):>14} "
            f"{len(files):>5} {world:>5}  {tag}{mark}{why}"
        )
    return 0


def _problems(run: RunStore, tag: str, files: dict[str, int]) -> tuple[list[str], str]:
    """What keeps a checkpoint from being complete, from the listing alone (a readable manifest, and
    every file it lists present at its size; checksums are `verify`'s), and its world size."""
    if MANIFEST not in files:
        return [f"no {MANIFEST} yet"], "-"
    try:
        manifest = run.manifest(tag)
    except errors.VitforgeError as e:
        return [str(e)], "-"
    return run.listed_problems(tag, manifest, files), str(manifest.get("world_size", "?"))


def _verify(target: str) -> int:
    run_url, tag = split_checkpoint_url(target)
    if tag is None:
        run = RunStore(run_url)
        tags = run.complete_tags()
        if not tags:
            raise errors.CheckpointError(f"{run_url}: no complete checkpoint to verify")
    else:
        run, tags = RunStore(run_url), [tag]
    failed = 0
    for tag in tags:
        problems = run.verify(tag)
        print(f"{run.object_url(tag)}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return errors.CHECK_FAILED if failed else errors.OK
