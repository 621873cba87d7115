"""The data-scale study end to end with tiny sizes: launched locally and through the real SLURM
fixture, then collected from the runs into a table, numbers and a plot."""

from __future__ import annotations

import json

import pytest

from conftest import EXTENSIONS, REPO, vitforge
from test_cluster import _wait


def study_files(data, tmp_path, models: list[str], subsets: list, ranks: int) -> str:
    launch = tmp_path / "launch.yaml"
    launch.write_text(f"""name: study
nodes: 1
gpus_per_node: 0
tasks_per_node: {ranks}
cpus_per_task: 1
time: "00:20:00"
signal_lead_s: 60
venv: {REPO / '.venv'}
log_dir: {tmp_path / 'logs'}
train:
  config: tiny_cpu
  overrides: [data.backend=torch, data.workers=0]
""")
    study = tmp_path / "study.yaml"
    study.write_text(f"""name: scale
launch: {launch}
checkpoint_dir: {tmp_path / 'runs'}
models: {json.dumps(models)}
subsets: {json.dumps(subsets)}
overrides: [data.train={data / 'train'}, data.val={data / 'val'}, train.steps=20, train.eval_every=20,
            train.checkpoint_every=20, train.log_every=10]
local_ranks: {ranks}
""")
    return str(study)


def check_collected(tmp_path, study: str, expected: dict) -> None:
    out = tmp_path / "results"
    printed = vitforge("study", "collect", study, "--out", out).stdout
    rows = json.loads((out / "data_scale.json").read_text())
    assert {(r["model"], r["subset"]): r["train_samples"] for r in rows} == expected
    for row in rows:
        metrics = [json.loads(line) for line in (tmp_path / "runs" / row["run"].rsplit("/", 1)[1] /
                                                 "metrics.jsonl").read_text().splitlines()]
        assert row["eval_top1"] == [m for m in metrics if "eval_top1" in m][-1]["eval_top1"]
        assert row["step"] == 20 and row["samples_seen"] == 20 * 32 and row["eval_samples"] == 100
        line = f"| {row['model']} | {row['subset']} | {row['train_samples']} | 640 | {row['eval_top1']:.4f} |"
        assert line in printed
    assert (out / "data_scale.png").stat().st_size > 1000 and (out / "data_scale.md").read_text().startswith("| model")


def test_a_data_scale_study_runs_locally_and_collects(data, tmp_path):
    study = study_files(data, tmp_path, ["vit_tiny_cpu", "vit_small_cpu"], [0.25, 1.0], ranks=1)
    scripts = vitforge("study", "data-scale", study, "--dry-run").stdout
    assert scripts.count("#!/bin/bash") == 4 and "--set data.subset=0.25 " in scripts
    assert "--set checkpoint.run=scale-vit_small_cpu-1.0" in scripts
    # Run across models here, across subsets on SLURM (below): each axis is run and collected once.
    study = study_files(data, tmp_path, ["vit_tiny_cpu", "vit_small_cpu"], [0.25], ranks=1)
    result = vitforge("study", "data-scale", study, "--local", env=EXTENSIONS, timeout=900)
    assert result.stdout.count("run scale-") == 2
    check_collected(tmp_path, study, {("vit_tiny_cpu", 0.25): 100, ("vit_small_cpu", 0.25): 100})


def test_a_data_scale_study_runs_on_slurm_and_collects(data, slurm, monkeypatch, tmp_path):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    study = study_files(data, tmp_path, ["vit_tiny_cpu"], [100, 1.0], ranks=2)
    submitted = vitforge("study", "data-scale", study, env=EXTENSIONS).stdout
    jobs = [line.split(" as job ")[1].split(":")[0] for line in submitted.splitlines() if " as job " in line]
    assert len(jobs) == 2
    for job in jobs:
        assert _wait(job)["state"] == "COMPLETED"
    check_collected(tmp_path, study, {("vit_tiny_cpu", 100): 100, ("vit_tiny_cpu", 1.0): 400})


def test_bad_study_specs_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlaunch: tiny_cpu\ncheckpoint_dir: runs\nmodels: [vit_tiny_cpu]\nsubsets: [1.5]\n")
    result = vitforge("study", "collect", bad, "--out", tmp_path, check=False)
    assert result.returncode == 2 and "subsets" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("missing", ["models", "launch"])
def test_a_study_spec_without_a_required_key_is_refused(tmp_path, missing):
    spec = {"name": "x", "launch": "tiny_cpu", "checkpoint_dir": "runs", "models": "[vit_tiny_cpu]", "subsets": "[1.0]"}
    del spec[missing]
    path = tmp_path / "s.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in spec.items()))
    result = vitforge("study", "data-scale", path, "--dry-run", check=False)
    assert result.returncode == 2 and missing in result.stderr
