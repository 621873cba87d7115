"""`vitforge study data-scale SPEC`, `vitforge study collect SPEC --out DIR`: the ViT paper's
data-scale experiment (held-out accuracy against pre-training set size, one line per model).

  vitforge study data-scale my_study.yaml             one sbatch job per (model, subset)
  vitforge study data-scale my_study.yaml --local     the runs here, one after another (torchrun)
  vitforge study data-scale my_study.yaml --dry-run   print the scripts
  vitforge study collect my_study.yaml --out results  table (.md), numbers (.json) and plot (.png)

A study spec (YAML): name, launch (a launch spec: resources and the trainer recipe), checkpoint_dir,
models, subsets (data.subset values: the smaller subsets lie inside the larger ones), overrides
(trainer --set for every run), local_ranks. Shipped: tiny_cpu_data_scale.
"""

from __future__ import annotations

import argparse
import os

from vitforge.core import setup_logging

from . import slurm
from .spec import check_against
from .study import collect, load_study, run_locally, runs, scripts, table, write_results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("data-scale", help="launch one training run per (model, subset)")
    gather = sub.add_parser("collect", help="gather the runs' final evaluations into a table and a plot")
    for parser in (launch, gather):
        parser.add_argument("spec", help="a study spec YAML file, or a shipped one")
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                            help="override a study spec value, e.g. --set subsets=[0.1,1.0]")
    mode = launch.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="run here with torchrun, one run after another")
    mode.add_argument("--dry-run", action="store_true", help="print the sbatch scripts instead of submitting")
    gather.add_argument("--out", required=True, help="folder for data_scale.md, .json and .png")
    args = p.parse_args(argv)
    setup_logging()
    study = load_study(args.spec, args.overrides)
    if args.command == "collect":
        rows = collect(study)
        paths = write_results(rows, args.out)
        print(table(rows))
        print(f"wrote {', '.join(paths)}")
        return 0
    if args.dry_run:
        print("\n".join(script for _, _, script in scripts(study)), end="")
        return 0
    if args.local:
        for run in runs(study):
            print(f"run {run.name}: model {run.model}, subset {run.subset}", flush=True)
            code = run_locally(study, run)
            if code:
                print(f"run {run.name} failed (exit {code}); later runs not started")
                return code
        return 0
    for run, spec, script in scripts(study):
        check_against(spec, slurm.partition_limits(spec.partition))
        os.makedirs(spec.log_dir, exist_ok=True)
        path = os.path.join(spec.log_dir, f"{run.name}.sbatch")
        with open(path, "w") as f:
            f.write(script)
        job = slurm.submit(path)
        print(f"submitted {run.name} as job {job}: model {run.model}, subset {run.subset}, script {path}")
    return 0
