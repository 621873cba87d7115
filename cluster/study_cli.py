"""`vitforge study data-scale|compute SPEC`, `vitforge study collect SPEC --out DIR`: the ViT paper's
data-scale and compute experiments (accuracy against pre-training set size, and against
pre-training FLOPs, one line per model: ViTs beside BiT ResNets).

  vitforge study data-scale my_study.yaml             one SLURM job array: a task per (model, subset, length)
  vitforge study compute my_study.yaml                the same (a spec with several `steps`)
  vitforge study data-scale my_study.yaml --local     the runs here, one after another (torchrun)
  vitforge study data-scale my_study.yaml --dry-run   print the array's sbatch script
  vitforge study collect my_study.yaml --out results  table (.md), numbers (.json), plots (.png)

A study spec (YAML): name, launch (a launch spec: resources and the trainer recipe), checkpoint_dir,
models, subsets (data.subset values: the smaller subsets lie inside the larger ones), steps
(training lengths, one run each; [] for the recipe's), metric (the figures' y; default: the
few-shot top-1 with the most shots, which the runs report with eval.probes and eval.fewshot in
their overrides), overrides (trainer --set for every run), local_ranks; for a mixture study,
mixture (source URLs) and weights (settings, one weight per source each: a run per setting).
Shipped: tiny_cpu_data_scale, paper_data_scale, paper_compute.
"""

from __future__ import annotations

import argparse
import os

from vitforge.core import setup_logging

from . import slurm
from .spec import check_against
from .study import (
    StudyError,
    StudySpec,
    array_script,
    check_runs,
    collect,
    figure_metric,
    load_study,
    run_locally,
    runs,
    table,
    write_results,
)


def describe(run) -> str:
    weights = f", weights {'/'.join(f'{w:g}' for w in run.weights)}" if run.weights else ""
    return f"model {run.model}, subset {run.subset}, steps {run.steps or 'as the recipe'}{weights}"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    setup_logging()
    study = load_study(args.spec, args.overrides)
    if args.command == "collect":
        rows = collect(study)
        metric = figure_metric(rows, study.metric)
        paths = write_results(rows, args.out, metric)
        print(table(rows, metric))
        print(f"wrote {', '.join(paths)}")
        return 0
    if args.command == "compute" and len(study.steps) < 2:
        raise StudyError(
            f"{args.spec}: a compute study trains each model for several lengths: give `steps` at least "
            f"two values (e.g. [512695, 1025390]), not {study.steps}"
        )
    check_runs(study)
    if args.dry_run:
        print(array_script(study)[1], end="")
        return 0
    if args.local:
        return _run_here(study)
    return _submit(study)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vitforge study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    launches = [
        sub.add_parser(name, help=f"launch one training run per (model, subset, length): {what}")
        for name, what in (
            ("data-scale", "accuracy against training-set size"),
            ("compute", "accuracy against pre-training FLOPs"),
        )
    ]
    gather = sub.add_parser("collect", help="gather the runs' final evaluations into a table and plots")
    for parser in (*launches, gather):
        parser.add_argument("spec", help="a study spec YAML file, or a shipped one")
        parser.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a study spec value, e.g. --set subsets=[0.1,1.0]",
        )
    for launch in launches:
        mode = launch.add_mutually_exclusive_group()
        mode.add_argument("--local", action="store_true", help="run here with torchrun, one run after another")
        mode.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting")
    gather.add_argument("--out", required=True, help="folder for data_scale.md, .json, data_scale.png and compute.png")
    return p


def _run_here(study: StudySpec) -> int:
    """The study's runs on this machine, one after another; the first that fails stops the rest."""
    for run in runs(study):
        print(f"run {run.name}: {describe(run)}", flush=True)
        code = run_locally(study, run)
        if code:
            print(f"run {run.name} failed (exit {code}); later runs not started")
            return code
    return 0


def _submit(study: StudySpec) -> int:
    """The study's runs as one SLURM job array, its script kept in the launch spec's log folder."""
    spec, script = array_script(study)
    check_against(spec, slurm.partition_limits(spec.partition))
    os.makedirs(spec.log_dir, exist_ok=True)
    path = os.path.join(spec.log_dir, f"{study.name}.sbatch")
    with open(path, "w") as f:
        f.write(script)
    job = slurm.submit(path)
    for task, run in enumerate(runs(study)):
        print(f"submitted {run.name} as job {job}_{task}: {describe(run)}")
    print(f"job array {job}: {len(runs(study))} task(s), script {path}")
    return 0
