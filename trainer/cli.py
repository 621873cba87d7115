"""`vitforge train CONFIG` and `vitforge eval CONFIG --checkpoint RUN`: launch in every process of the job.

One process: `vitforge train tiny_cpu`. Several: `torchrun --nproc_per_node 2 -m vitforge train tiny_cpu`,
the `deepspeed` launcher, or `srun` (SLURM's variables are mapped to RANK/WORLD_SIZE/...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pipeline import DatasetError

from .config import RECIPES, ConfigError, load_config


def _parser(prog: str, evaluate: bool) -> argparse.ArgumentParser:
    shipped = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help=f"a YAML config file, or a shipped recipe: {shipped}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 --set data.train=s3://b/ds (repeatable)")
    if evaluate:
        p.add_argument("--checkpoint", required=True, help="the run folder whose latest checkpoint to evaluate")
    return p


def main(argv: list[str], evaluate: bool = False) -> int:
    args = _parser("vitforge eval" if evaluate else "vitforge train", evaluate).parse_args(argv)
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(args.config, args.overrides)
        from .train import run

        result = run(cfg, evaluate_only=args.checkpoint if evaluate else None)
    except ConfigError as e:
        print(f"vitforge: config error: {e}", file=sys.stderr)
        return 2
    except DatasetError as e:
        print(f"vitforge: data error: {e}", file=sys.stderr)
        return 2
    if rank == "0":
        print(json.dumps(result, sort_keys=True))
    return 0
