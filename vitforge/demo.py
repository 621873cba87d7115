"""`vitforge demo`: the whole job end to end on a fresh machine, on embedded defaults.

  1. generate a learnable corpus: JPEGs in 10 classes, varied sizes and aspect ratios, plus
     broken files the sharder must reject and report
  2. start an object store on 127.0.0.1 (SeaweedFS; a local folder if it cannot start)
  3. shard the corpus into the store, then verify every shard
  4. train a tiny ViT with ZeRO-2 on 2 CPU processes, the DALI CPU loader reading from the store,
     checkpoints to the store; SIGUSR1 a third of the way in, and the run resumes from the store
     (a private local SLURM requeues the job when SLURM's daemons are installed and this is
     root; otherwise the demo relaunches the ranks itself)
  5. evaluate the checkpoint on held-out shards
  6. export the weights to safetensors and reload them in timm
  7. draw the ViT paper's figures for the trained model
  8. write DEMO/report.md: summary table, curves, throughput, the shard report, where everything is

Every step is a `vitforge` command, printed before it runs: the same commands work on real data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from vitforge.core.cli_args import bounded, positive_int

from .demo_report import write_report
from .demo_stages import Demo, DemoError, draw_figures, evaluate, export, make_corpus, shard, start_store
from .demo_train import train


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vitforge demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="demo-out", help="working folder (default ./demo-out, replaced)")
    p.add_argument(
        "--images", type=bounded(int, low=100), default=3000, help="training images to generate (default 3000)"
    )
    p.add_argument("--val-images", type=bounded(int, low=10), default=500, help="held-out images (default 500)")
    p.add_argument("--steps", type=bounded(int, low=20), default=600, help="training steps of 32 images (default 600)")
    p.add_argument("--workers", type=positive_int, default=2, help="sharding processes (default 2)")
    p.add_argument(
        "--store",
        choices=("auto", "local"),
        default="auto",
        help="auto: an S3 server on 127.0.0.1 (a local folder if it cannot start); local: a folder",
    )
    p.add_argument(
        "--launcher",
        choices=("auto", "slurm", "direct"),
        default="auto",
        help="auto: a private local SLURM when its daemons are installed and this is root, else direct",
    )
    args = p.parse_args(argv)
    demo = Demo(args.out, args.images, args.val_images, args.steps, args.workers, args.store, args.launcher)
    started = time.monotonic()
    shutil.rmtree(demo.out, ignore_errors=True)
    os.makedirs(demo.out)
    stops = []
    try:
        make_corpus(demo)
        stops.append(start_store(demo))
        shard(demo)
        stops.append(train(demo))
        evaluate(demo)
        export(demo)
        draw_figures(demo)
        demo.say("report")
        demo.facts["minutes"] = (time.monotonic() - started) / 60
        report = write_report(demo.path(), demo.facts)
        print(f"wrote {report} ({demo.facts['minutes']:.1f} minutes in all)")
        return 0
    except DemoError as e:
        print(f"vitforge demo: stage {demo.stage} failed: {e}", file=sys.stderr)
        return e.code
    finally:
        for stop in reversed([s for s in stops if s]):
            stop()
