"""The ViT paper's central experiments as commands: accuracy against pre-training set size
(Figures 3 and 4) and against pre-training compute (Figure 5), ViTs beside BiT ResNets.

A study spec names a launch spec, the models, the training-set subsets (the loader's nested
`data.subset`, so the smaller sets are inside the larger ones) and, for a compute study, training
lengths; `runs` expands it to one training job per (model, subset, length), each its own run under
`checkpoint_dir`, launched through `cluster/` (one SLURM job array, a task per run) or locally one
after another. Every run is evaluated at its end by the recipe's evaluators (with eval.probes:
few-shot linear top-1, the paper's measure). `collect` reads every run's final evaluation back
into a table, the numbers and two plots (the figure's metric against training samples, and
against training FLOPs), from the runs themselves (local or s3://), so it works whatever launched
them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from pydantic import Field, field_validator

from vitforge.core import UsageError, free_port
from vitforge.core.settings import Strict, load_validated, validated
from vitforge.trainer import RunStore

from .render import render, trainer_command
from .spec import LaunchSpec, load_spec

STUDIES = Path(__file__).parent / "studies"


class StudyError(UsageError):
    pass


class StudySpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    launch: str  # a launch spec (name or YAML) every run uses; its train.config is the recipe
    checkpoint_dir: str  # the runs go to CHECKPOINT_DIR/NAME-MODEL-SUBSET (local or s3://)
    models: list[str] = Field(min_length=1)
    subsets: list[float | int] = Field(min_length=1)  # data.subset values: fractions (0.1) or counts (5000)
    steps: list[int] = []  # train.steps values, one run each (a compute study); []: the recipe's
    # the figures' y: a key of each run's last evaluation (eval_top1, eval_fewshot_pets_5shot); null:
    # the few-shot top-1 with the most shots when the runs have one, else the held-out top-1
    metric: str | None = None
    overrides: list[str] = []  # trainer --set KEY=VALUE for every run
    # trainer --set KEY=VALUE for the models whose name matches a pattern (fnmatch), after `overrides`:
    # e.g. {"resnetv2_*": [model.pre_logits=false]} where the recipe's ViT settings do not fit a ResNet
    model_overrides: dict[str, list[str]] = {}
    local_ranks: int = Field(2, ge=1)  # processes per run when launched locally (torchrun)
    # A mixture study: every run trains on these sources (data.train as a list), once per weight
    # setting in `weights` (one weight per source each), collected like the subsets.
    mixture: list[str] = []
    weights: list[list[float]] = []

    @field_validator("subsets")
    @classmethod
    def _subsets(cls, values):
        for value in values:
            if not (0 < value <= 1 if isinstance(value, float) else value >= 1):
                raise ValueError(f"{value!r}: a fraction in (0, 1] or a sample count >= 1")
        return values

    @field_validator("steps")
    @classmethod
    def _steps(cls, values):
        if any(v < 1 for v in values):
            raise ValueError(f"training lengths must be >= 1 step, not {values}")
        return values

    @field_validator("weights")
    @classmethod
    def _weights(cls, values, info):
        sources = info.data.get("mixture", [])
        if values and not sources:
            raise ValueError("weights vary a mixture: name its sources in `mixture`")
        for setting in values:
            if len(setting) != len(sources) or not all(w > 0 for w in setting):
                raise ValueError(f"{setting}: one weight > 0 for each of the {len(sources)} sources of `mixture`")
        return values


@dataclass(frozen=True)
class StudyRun:
    model: str
    subset: float | int
    steps: int | None  # None: the recipe's
    weights: tuple[float, ...] | None  # the mixture's weights (StudySpec.mixture); None: the recipe's data.train
    name: str
    url: str
    overrides: list[str]


def load_study(path: str, overrides: Sequence[str] = ()) -> StudySpec:
    return load_validated(path, list(overrides), StudySpec, STUDIES, "study spec", StudyError)


def runs(study: StudySpec) -> list[StudyRun]:
    """One run per (model, subset, training length, mixture weights), smallest subset and shortest
    length first."""
    out = []
    for model in study.models:
        for subset in study.subsets:
            for steps in study.steps or [None]:
                for weights in study.weights or [None]:
                    length = f"-{steps}steps" if steps else ""
                    mixed = "-w" + "-".join(f"{w:g}" for w in weights) if weights else ""
                    name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{study.name}-{model}-{subset}{length}{mixed}")
                    mine = [
                        item
                        for pattern, items in study.model_overrides.items()
                        if fnmatch(model, pattern)
                        for item in items
                    ]
                    train = [f"data.train={_mixture(study.mixture, weights)}"] if weights else []
                    out.append(
                        StudyRun(
                            model,
                            subset,
                            steps,
                            tuple(weights) if weights else None,
                            name,
                            f"{study.checkpoint_dir.rstrip('/')}/{name}",
                            [
                                *study.overrides,
                                *mine,
                                f"model.name={model}",
                                f"data.subset={subset}",
                                *([f"train.steps={steps}"] if steps else []),
                                *train,
                                f"checkpoint.dir={study.checkpoint_dir}",
                                f"checkpoint.run={name}",
                            ],
                        )
                    )
    return out


def _mixture(urls: list[str], weights: list[float]) -> str:
    """data.train's value for a mixture, as a --set takes it (YAML)."""
    return json.dumps([{"url": url, "weight": weight} for url, weight in zip(urls, weights)])


def launch_spec(study: StudySpec, run: StudyRun) -> LaunchSpec:
    spec = load_spec(study.launch)
    train = {**spec.train.model_dump(), "overrides": [*spec.train.overrides, *run.overrides], "checkpoint_dir": None}
    # validated again: the study's models and overrides reach the job script like the spec's own values
    return validated(
        {**spec.model_dump(), "name": run.name, "train": train}, LaunchSpec, f"study run {run.name}", StudyError
    )


def check_runs(study: StudySpec) -> None:
    """Each model's trainer config loads and fits the model (a ViT-only setting on a ResNet, an
    unknown model, a bad override): one error naming the run, before any job is submitted. One run
    per model: its other runs differ only in data.subset, train.steps and their names."""
    from vitforge.trainer import ConfigError, check_model_config, load_config

    for run in {run.model: run for run in runs(study)}.values():
        spec = launch_spec(study, run)
        command = trainer_command(spec)
        overrides = [command[i + 1] for i, arg in enumerate(command) if arg == "--set"]
        try:
            cfg = load_config(spec.train.config, overrides)
            check_model_config(cfg.model, cfg.train.objective)
        except ConfigError as e:
            raise StudyError(f"study run {run.name}: {e}") from None


def array_script(study: StudySpec) -> tuple[LaunchSpec, str]:
    """The study as one SLURM job array, task i running runs(study)[i] with the launch spec's
    resources (each task requeued on its own): the job's spec and its sbatch script."""
    tasks = [launch_spec(study, run) for run in runs(study)]
    spec = tasks[0].model_copy(update={"name": study.name})
    return spec, render(spec, tasks)


def run_locally(study: StudySpec, run: StudyRun) -> int:
    """The run under torchrun on this machine, `local_ranks` processes; its exit code."""
    command = trainer_command(launch_spec(study, run))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(study.local_ranks),
            "--master_port",
            str(free_port()),
            "-m",
            "vitforge",
            *command[1:],
        ]
    ).returncode


def collect(study: StudySpec) -> list[dict]:
    """Every run's final evaluation: model, subset, training samples, steps, samples seen, the
    training FLOPs (3 x the forward pass's per image x samples seen, torch's FLOP counter on the
    meta device, as the trainer's MFU counts them), metrics."""
    from vitforge.trainer import forward_flops

    rows, per_image = [], {}
    for run in runs(study):
        results = RunStore(run.url).results()
        config = results["config"]
        model = config.get("model", {})
        shape = (
            model.get("name", run.model),
            model.get("image_size", 224),
            results.get("num_classes") or 1000,
            config.get("train", {}).get("objective", "classification"),
        )
        if shape not in per_image:
            per_image[shape] = 3 * forward_flops(*shape)
        seen = results["step"] * config.get("train", {}).get("global_batch", 0)
        rows.append(
            {
                "model": run.model,
                "subset": run.subset,
                "run": run.url,
                **({"weights": list(run.weights)} if run.weights else {}),
                "train_samples": results["train_samples"],
                "step": results["step"],
                "samples_seen": seen,
                "train_flops": per_image[shape] * seen,
                **{k: v for k, v in results.items() if k.startswith("eval_")},
            }
        )
    return rows


def figure_metric(rows: list[dict], asked: str | None = None) -> str | None:
    """The metric the table and plots show (StudySpec.metric)."""
    if asked:
        return asked
    keys = dict.fromkeys(k for row in rows for k in row)
    shots = {k: int(m[1]) for k in keys if (m := re.fullmatch(r"eval_fewshot_.+_(\d+)shot", k))}
    if shots:
        return max(shots, key=shots.get)
    return next((k for k in ("eval_top1", "eval_colour_top1") if k in keys), None)


def table(rows: list[dict], metric: str | None) -> str:
    mixed = any("weights" in row for row in rows)  # a mixture study: a column for each run's weights
    lines = [
        "| model | subset | " + ("weights | " if mixed else "") + "steps | training samples | samples seen | "
        "training FLOPs | " + (metric or "eval") + " |",
        "|---" * (7 + mixed) + "|",
    ]
    for row in rows:
        value = f"{row[metric]:.4f}" if metric and isinstance(row.get(metric), (int, float)) else "-"
        weights = f"{'/'.join(f'{w:g}' for w in row.get('weights', []))} | " if mixed else ""
        lines.append(
            f"| {row['model']} | {row['subset']} | {weights}{row['step']} | {row['train_samples']} | "
            f"{row['samples_seen']} | {row['train_flops']:.3g} | {value} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], metric: str | None, x: str, path: str) -> None:
    """`metric` against `x` (train_samples: the paper's Figures 3 and 4; train_flops: its Figure 5),
    one line per model and training length, log-scaled x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    # Across sizes, a line per training length; across compute, a line per model.
    line_of = (
        (lambda r: (r["model"], r["step"], *r.get("weights", [])))
        if x == "train_samples"
        else (lambda r: (r["model"], *r.get("weights", [])))
    )
    lengths = len({r["step"] for r in rows})
    for line in dict.fromkeys(map(line_of, rows)):
        mine = sorted((r for r in rows if line_of(r) == line and metric in r), key=lambda r: r[x])
        label = line[0] if x != "train_samples" or lengths == 1 else f"{line[0]}, {line[1]} steps"
        if len(line) > (2 if x == "train_samples" else 1):  # a mixture study: the weights
            label += ", weights " + "/".join(f"{w:g}" for w in line[2 if x == "train_samples" else 1 :])
        ax.plot([r[x] for r in mine], [r[metric] for r in mine], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("Training samples (pre-training set size)" if x == "train_samples" else "Pre-training FLOPs")
    ax.set_ylabel(metric or "eval")
    ax.legend()
    ax.set_title("Accuracy against " + ("training-set size" if x == "train_samples" else "pre-training compute"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_results(rows: list[dict], out: str, metric: str | None) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("data_scale.json", "data_scale.md", "data_scale.png", "compute.png")]
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(table(rows, metric) + "\n")
    plot(rows, metric, "train_samples", paths[2])
    plot(rows, metric, "train_flops", paths[3])
    return paths
