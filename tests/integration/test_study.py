"""The data-scale and compute studies end to end with tiny sizes: launched locally and through the
real SLURM fixture, each run probed by the few-shot evaluator at its end, then collected from the
runs into a table, numbers and two plots; the paper's study specs render."""

from __future__ import annotations

import json

import pytest

from common.cli import EXTENSIONS, REPO, vitforge
from test_cluster import _wait
from vitforge.cluster.study import table as study_table


def study_files(data, tmp_path, models: list[str], subsets: list, ranks: int, steps: list[int] = ()) -> str:
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
steps: {json.dumps(list(steps))}
overrides: [data.train={data / 'train'}, data.val={data / 'val'}, train.steps=20, train.eval_every=20,
            train.checkpoint_every=20, train.log_every=10, "eval.fewshot=[1,5]",
            "eval.probes={{digits: {{train: {data / 'train'}, test: {data / 'val'}}}}}"]
local_ranks: {ranks}
""")
    return str(study)


def check_collected(tmp_path, study: str, expected: dict) -> None:
    """`expected`: (model, subset, steps) -> training samples."""
    from vitforge.trainer import forward_flops

    out = tmp_path / "results"
    printed = vitforge("study", "collect", study, "--out", out).stdout
    rows = json.loads((out / "data_scale.json").read_text())
    assert {(r["model"], r["subset"], r["step"]): r["train_samples"] for r in rows} == expected
    assert "| eval_fewshot_digits_5shot |" in printed.splitlines()[0]  # the most shots: the figures' metric
    for row in rows:
        metrics = [json.loads(line) for line in (tmp_path / "runs" / row["run"].rsplit("/", 1)[1] /
                                                 "metrics.jsonl").read_text().splitlines()]
        last = [m for m in metrics if "eval_top1" in m][-1]
        assert row["eval_top1"] == last["eval_top1"] and last["step"] == row["step"]
        assert row["eval_fewshot_digits_5shot"] == last["eval_fewshot_digits_5shot"]
        assert row["samples_seen"] == row["step"] * 32 and row["eval_samples"] == 100
        assert row["train_flops"] == 3 * forward_flops(row["model"], 32, 10) * row["samples_seen"]
        line = (f"| {row['model']} | {row['subset']} | {row['step']} | {row['train_samples']} | {row['samples_seen']} "
                f"| {row['train_flops']:.3g} | {row['eval_fewshot_digits_5shot']:.4f} |")
        assert line in printed
    for plot in ("data_scale.png", "compute.png"):
        assert (out / plot).stat().st_size > 1000
    assert (out / "data_scale.md").read_text().startswith("| model")


@pytest.mark.slow
def test_a_data_scale_study_runs_locally_and_collects(data, tmp_path):
    study = study_files(data, tmp_path, ["vit_tiny_cpu", "vit_small_cpu"], [0.25, 1.0], ranks=1)
    scripts = vitforge("study", "data-scale", study, "--dry-run").stdout
    # One job array, a task per run, each its own trainer command.
    assert scripts.count("#!/bin/bash") == 1 and "#SBATCH --array=0-3\n" in scripts and "%x-%A_%a.out" in scripts
    assert scripts.count(") command=(vitforge train ") == 4 and "--set data.subset=0.25 " in scripts
    assert "--set checkpoint.run=scale-vit_small_cpu-1.0)" in scripts
    # Run across model families here (a ViT beside a BiT ResNet), across subsets on SLURM (below): each
    # axis is run and collected once.
    study = study_files(data, tmp_path, ["vit_tiny_cpu", "bit_tiny_cpu"], [0.25], ranks=1)
    result = vitforge("study", "data-scale", study, "--local", env=EXTENSIONS, timeout=900)
    assert result.stdout.count("run scale-") == 2
    check_collected(tmp_path, study, {("vit_tiny_cpu", 0.25, 20): 100, ("bit_tiny_cpu", 0.25, 20): 100})


@pytest.mark.slow(seconds=70)
def test_a_data_scale_study_runs_on_slurm_and_collects(data, slurm, monkeypatch, tmp_path):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    study = study_files(data, tmp_path, ["vit_tiny_cpu"], [100, 1.0], ranks=2)
    submitted = vitforge("study", "data-scale", study, env=EXTENSIONS).stdout
    jobs = [line.split(" as job ")[1].split(":")[0] for line in submitted.splitlines() if " as job " in line]
    assert len(jobs) == 2 and jobs[1] == jobs[0].replace("_0", "_1")  # the tasks of one job array
    for job in jobs:
        assert _wait(job)["state"] == "COMPLETED"
    check_collected(tmp_path, study, {("vit_tiny_cpu", 100, 20): 100, ("vit_tiny_cpu", 1.0, 20): 400})


@pytest.mark.slow
def test_the_paper_studies_render_vits_beside_bit_resnets():
    data_scale = vitforge("study", "data-scale", "paper_data_scale", "--dry-run").stdout
    assert data_scale.count(") command=(vitforge train ") == 6 * 4 and "#SBATCH --array=0-23\n" in data_scale
    assert "--set model.name=resnetv2_152x2_bit --set data.subset=0.03 " in data_scale
    assert "'eval.fewshot=[1,5,10,25]'" in data_scale
    compute = vitforge("study", "compute", "paper_compute", "--dry-run").stdout
    assert compute.count(") command=(vitforge train ") == 7 * 2
    assert "--set model.name=vit_huge_patch14_224 --set data.subset=1.0 --set train.steps=1025390 " in compute
    # model_overrides, by pattern: the ResNets leave the ViT recipe's pre-training head out.
    assert "--set model.pre_logits=false --set model.name=resnetv2_50x1_bit " in compute
    assert "--set model.pre_logits=false --set model.name=vit_" not in compute


@pytest.mark.slow
def test_a_run_whose_settings_do_not_fit_its_model_is_refused_before_any_job(data, tmp_path):
    study = study_files(data, tmp_path, ["vit_tiny_cpu", "bit_tiny_cpu"], [1.0], ranks=1)
    with open(study, "a") as f:
        f.write("model_overrides: {'*': [model.pre_logits=true]}\n")
    result = vitforge("study", "data-scale", study, "--dry-run", check=False)
    assert result.returncode == 2 and "study run scale-bit_tiny_cpu-1.0: model.pre_logits: bit_tiny_cpu is not a ViT" \
        in result.stderr and "#!/bin/bash" not in result.stdout


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


def test_a_mixture_study_runs_once_per_weight_setting_and_collects_the_weights(data, tmp_path):
    study = study_files(data, tmp_path, ["vit_tiny_cpu"], [1.0], ranks=1)
    a, b = data / "train", data / "val"
    with open(study, "a") as f:
        f.write(f"mixture: [{a}, {b}]\nweights: [[0.7, 0.3], [0.5, 0.5]]\n")
    script = vitforge("study", "data-scale", study, "--dry-run").stdout
    assert "#SBATCH --array=0-1\n" in script and "--set checkpoint.run=scale-vit_tiny_cpu-1.0-w0.7-0.3)" in script
    assert f'data.train=[{{"url": "{a}", "weight": 0.5}}, {{"url": "{b}", "weight": 0.5}}]' in script
    rows = [{"model": "vit_tiny_cpu", "subset": 1.0, "weights": w, "step": 20, "train_samples": 500, "samples_seen": 640,
             "train_flops": 1e12, "eval_top1": top1} for w, top1 in (([0.7, 0.3], 0.5), ([0.5, 0.5], 0.25))]
    text = study_table(rows, "eval_top1")
    assert text.splitlines()[0].startswith("| model | subset | weights | steps |")
    assert "| vit_tiny_cpu | 1.0 | 0.7/0.3 | 20 | 500 | 640 | 1e+12 | 0.5000 |" in text
    for bad, words in (("weights: [[0.7]]", "one weight > 0 for each of the 2 sources"),
                       ("weights: [[0.7, 0]]", "one weight > 0 for each of the 2 sources")):
        spec = tmp_path / "bad.yaml"
        spec.write_text(open(study).read().replace("weights: [[0.7, 0.3], [0.5, 0.5]]", bad))
        result = vitforge("study", "data-scale", spec, "--dry-run", check=False)
        assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
