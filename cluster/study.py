"""The ViT paper's central experiment as a command: accuracy against pre-training set size.

A study spec names a launch spec, the training-set subsets (the loader's nested `data.subset`, so
the smaller sets are inside the larger ones) and the models; `runs` expands it to one training job
per (model, subset), each its own run under `checkpoint_dir`, launched through `cluster/` (sbatch)
or locally one after another. `collect` reads every run's final evaluation back into a table and a
plot, from the runs themselves (local or s3://), so it works whatever launched them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator

from vitforge.core import UsageError, free_port
from vitforge.core.settings import load_validated, validated
from vitforge.trainer import RunStore

from .render import render, trainer_command
from .spec import LaunchSpec, Strict, load_spec

STUDIES = Path(__file__).parent / "studies"


class StudyError(UsageError):
    pass


class StudySpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    launch: str  # a launch spec (name or YAML) every run uses; its train.config is the recipe
    checkpoint_dir: str  # the runs go to CHECKPOINT_DIR/NAME-MODEL-SUBSET (local or s3://)
    models: list[str] = Field(min_length=1)
    subsets: list[float | int] = Field(min_length=1)  # data.subset values: fractions (0.1) or counts (5000)
    overrides: list[str] = []  # trainer --set KEY=VALUE for every run
    local_ranks: int = Field(2, ge=1)  # processes per run when launched locally (torchrun)

    @field_validator("subsets")
    @classmethod
    def _subsets(cls, values):
        for value in values:
            if not (0 < value <= 1 if isinstance(value, float) else value >= 1):
                raise ValueError(f"{value!r}: a fraction in (0, 1] or a sample count >= 1")
        return values


@dataclass(frozen=True)
class StudyRun:
    model: str
    subset: float | int
    name: str
    url: str
    overrides: list[str]


def load_study(path: str, overrides: list[str] = ()) -> StudySpec:
    return load_validated(path, list(overrides), StudySpec, STUDIES, "study spec", StudyError)


def runs(study: StudySpec) -> list[StudyRun]:
    """One run per (model, subset), smallest subset first."""
    out = []
    for model in study.models:
        for subset in study.subsets:
            name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{study.name}-{model}-{subset}")
            out.append(StudyRun(model, subset, name, f"{study.checkpoint_dir.rstrip('/')}/{name}",
                                [*study.overrides, f"model.name={model}", f"data.subset={subset}",
                                 f"checkpoint.dir={study.checkpoint_dir}", f"checkpoint.run={name}"]))
    return out


def launch_spec(study: StudySpec, run: StudyRun) -> LaunchSpec:
    spec = load_spec(study.launch)
    train = {**spec.train.model_dump(), "overrides": [*spec.train.overrides, *run.overrides], "checkpoint_dir": None}
    # validated again: the study's models and overrides reach the job script like the spec's own values
    return validated({**spec.model_dump(), "name": run.name, "train": train}, LaunchSpec,
                     f"study run {run.name}", StudyError)


def scripts(study: StudySpec) -> list[tuple[StudyRun, LaunchSpec, str]]:
    """Each run, its launch spec and its sbatch script."""
    specs = [(run, launch_spec(study, run)) for run in runs(study)]
    return [(run, spec, render(spec)) for run, spec in specs]


def run_locally(study: StudySpec, run: StudyRun) -> int:
    """The run under torchrun on this machine, `local_ranks` processes; its exit code."""
    command = trainer_command(launch_spec(study, run))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(study.local_ranks), "--master_port", str(free_port()), "-m", "vitforge",
                           *command[1:]]).returncode


def collect(study: StudySpec) -> list[dict]:
    """Every run's final evaluation: model, subset, training samples, steps, samples seen, metrics."""
    rows = []
    for run in runs(study):
        results = RunStore(run.url).results()
        train = results["config"].get("train", {})
        rows.append({"model": run.model, "subset": run.subset, "run": run.url,
                     "train_samples": results["train_samples"], "step": results["step"],
                     "samples_seen": results["step"] * train.get("global_batch", 0),
                     **{k: v for k, v in results.items() if k.startswith("eval_")}})
    return rows


def table(rows: list[dict]) -> str:
    metric = next((k for k in ("eval_top1", "eval_colour_top1") if k in rows[0]), None) if rows else None
    lines = ["| model | subset | training samples | samples seen | " + (metric or "eval") + " |",
             "|---|---|---|---|---|"]
    for row in rows:
        value = f"{row[metric]:.4f}" if metric and metric in row else "-"
        lines.append(f"| {row['model']} | {row['subset']} | {row['train_samples']} | {row['samples_seen']} | {value} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Held-out top-1 against training-set size, one line per model (the paper's Figure 3/4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = sorted((r for r in rows if r["model"] == model and "eval_top1" in r), key=lambda r: r["train_samples"])
        ax.plot([r["train_samples"] for r in mine], [r["eval_top1"] for r in mine], marker="o", label=model)
    ax.set_xscale("log")
    ax.set_xlabel("Training samples (pre-training set size)")
    ax.set_ylabel("Held-out top-1")
    ax.legend()
    ax.set_title("Accuracy against training-set size")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_results(rows: list[dict], out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "data_scale.json"), os.path.join(out, "data_scale.md"),
             os.path.join(out, "data_scale.png")]
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(table(rows) + "\n")
    plot(rows, paths[2])
    return paths
