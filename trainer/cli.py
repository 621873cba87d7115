"""`vitforge train CONFIG [--profile FIRST:LAST]`, `vitforge eval CONFIG --checkpoint URL [--fewshot 1,5,10,25]`:
run in every process of the job.

One process: `vitforge train tiny_cpu`. Several: `torchrun --nproc_per_node 2 -m vitforge train tiny_cpu`,
the `deepspeed` launcher, or `srun` (SLURM's variables are mapped to RANK/WORLD_SIZE/...).
SIGUSR1 or SIGTERM (or train.max_minutes) makes every rank save a complete checkpoint and exit
with code 75: run the same command again (or requeue the job) to resume from it.
"""

from __future__ import annotations

import argparse
import json

from vitforge.core import process_rank, setup_logging

from .config import RECIPES, load_config
from .ops import use_op_cache


def _parser(prog: str, evaluate: bool) -> argparse.ArgumentParser:
    shipped = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help=f"a YAML config file, or a shipped recipe: {shipped}")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=100 --set data.train=s3://b/ds (repeatable)",
    )
    if evaluate:
        p.add_argument(
            "--checkpoint",
            required=True,
            help="a run (DIR/RUN: its newest complete checkpoint) or one checkpoint (DIR/RUN/step_N), "
            "local or s3://; the model and class map come from its manifest",
        )
        p.add_argument(
            "--fewshot",
            metavar="K,K,...",
            type=_shots,
            help="linear few-shot top-1 on eval.probes with K images per class, e.g. 1,5,10,25 "
            "(sets eval.fewshot); with no data.val, only the probes run",
        )
    else:
        p.add_argument(
            "--profile",
            metavar="FIRST:LAST",
            type=_window,
            help="record torch.profiler traces of optimizer steps FIRST to LAST on every rank into "
            "RUN/profile/ (Chrome/Perfetto JSON that TensorBoard also reads; CUDA memory "
            "snapshots on a GPU), e.g. 100:105 (sets train.profile_steps)",
        )
    return p


def _shots(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected shots per class like 1,5,10,25") from None


def _window(text: str) -> list[int]:
    first, sep, last = text.partition(":")
    try:
        window = [int(first), int(last)] if sep else []
    except ValueError:
        window = []
    if not window or not 1 <= window[0] <= window[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected steps FIRST:LAST with 1 <= FIRST <= LAST, e.g. 100:105")
    return window


def main(argv: list[str], evaluate: bool = False) -> int:
    args = _parser("vitforge eval" if evaluate else "vitforge train", evaluate).parse_args(argv)
    setup_logging()
    use_op_cache()
    overrides = (
        args.overrides
        + ([f"eval.fewshot={args.fewshot}"] if getattr(args, "fewshot", None) else [])
        + ([f"train.profile_steps={args.profile}"] if getattr(args, "profile", None) else [])
    )
    cfg = load_config(args.config, overrides)
    if evaluate:
        from .entry import run_eval

        overridden = {
            item.partition("=")[0].removeprefix("model.") for item in args.overrides if item.startswith("model.")
        }
        result = run_eval(cfg, args.checkpoint, overridden)
    else:
        from .entry import run

        result = run(cfg)
    if process_rank() == 0:
        print(json.dumps(result, sort_keys=True))
    return 0
