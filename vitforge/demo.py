"""`vitforge demo`: the main job end to end on embedded defaults.

For now: generate a small learnable corpus, shard it, verify the shards, print the report.
"""

from __future__ import annotations

import argparse
import os
import shutil

from vitforge.shards.cli import main as shard_main
from vitforge.trainer.cli import main as trainer_main

from .synthetic import write_class_folders


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo-out", help="working folder (default ./demo-out, replaced)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    corpus, shards = os.path.join(args.out, "corpus"), os.path.join(args.out, "shards")
    val_corpus, val_shards = os.path.join(args.out, "val-corpus"), os.path.join(args.out, "val-shards")
    paths = write_class_folders(corpus, args.classes, args.per_class)
    write_class_folders(val_corpus, args.classes, 10, seed=1)
    print(f"== generated {len(paths)} images in {args.classes} classes under {corpus} (and a held-out set)")
    steps = [
        ["shard", corpus, shards, "--shard-samples", "100", "--workers", str(args.workers)],
        ["shard", val_corpus, val_shards, "--prefix", "val", "--workers", str(args.workers)],
        ["shard", "verify", shards],
        ["shard", "info", shards],
    ]
    for step in steps:
        print("== vitforge " + " ".join(step))
        code = shard_main(step[1:])
        if code:
            return code
    train = ["tiny_cpu", "--set", f"data.train={shards}", "--set", f"data.val={val_shards}",
             "--set", f"checkpoint.dir={os.path.join(args.out, 'runs')}"]
    print("== vitforge train " + " ".join(train))
    return trainer_main(train)
