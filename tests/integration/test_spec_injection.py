"""Launch-spec values that reach an sbatch script. SLURM names, times, sizes and variable names
are refused by the schema when they carry shell or #SBATCH syntax, naming the field; paths and
free values (variable values, trainer overrides, container mounts, shard arguments) may carry it
and are written so that they stay data. Real jobs on the local SLURM prove nothing of it runs."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from common.cli import REPO, vitforge
from vitforge.cluster import load_spec, render, trainer_command
from vitforge.cluster import slurm as slurm_commands
from vitforge.cluster.render import render_merge, render_shard_array
from vitforge.core import errors


def hostile(mark: Path) -> str:
    """One line that runs `touch MARK` if any part of it reaches a shell unquoted, and breaks
    sbatch's #SBATCH parsing (space, '#', quotes) or SLURM's file patterns ('%') if unescaped."""
    return (f"a b#c%j'd\"e*f?[g] $(touch {mark}) `touch {mark}`; touch {mark} && touch {mark} | touch {mark} "
            f"${{IFS}}{{x,y}}~")


def refused(mark: Path) -> list[str]:
    """Values no SLURM name, time, size or variable name may have."""
    return [f"$(touch {mark})", f"`touch {mark}`", f"x;touch {mark}", f"x && touch {mark}", f"x\ntouch {mark}",
            "1\n", "x'y", 'x"y', "x y", "x?", "x#y", "x\\y", "x\x00y"]


RESTRICTED = ["name", "partition", "account", "qos", "constraint", "gpu_type", "time", "mem_per_node", "mem_per_cpu",
              "mem_per_gpu"]
# Free values: anything on one line; a newline, carriage return or NUL is refused.
FREE_TRAIN = ["log_dir", "venv", "env.VF_VALUE", "train.config", "train.overrides", "train.dataset",
              "train.checkpoint_dir", "container.image", "container.mounts"]
FREE_SHARD = ["shard.src", "shard.dest", "shard.args"]
LISTS = {"train.overrides", "container.mounts", "shard.args"}


def _set(field: str, value: str) -> str:
    """A --set item whose YAML value is exactly `value` (a one-item list for list fields)."""
    if field.startswith("container."):  # the section must be whole to validate
        section = {"image": "img", "mounts": []}
        section[field.split(".")[1]] = [value] if field in LISTS else value
        return f"container={json.dumps(section)}"
    return f"{field}={json.dumps([value] if field in LISTS else value)}"


def sbatch_block(script: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first line that is neither blank nor a comment."""
    block = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            block.append(line)
    return block


@pytest.mark.parametrize("field", RESTRICTED + ["env key"])
def test_shell_and_sbatch_syntax_in_slurm_names_is_refused_naming_the_field(field, tmp_path):
    for value in refused(tmp_path / "pwned"):
        item = f"env={json.dumps({value: '1'})}" if field == "env key" else _set(field, value)
        with pytest.raises(errors.UsageError) as e:
            load_spec("tiny_cpu", ["gpus_per_node=8", item])
        assert e.value.exit_code == errors.USAGE
        named = f"env.{value}.[key]" if field == "env key" else field
        assert f"{named}: {value!r}: " in str(e.value), (value, str(e.value))


def test_real_slurm_values_are_accepted():
    spec = load_spec("vit_h14_pretrain_1node", [_set("constraint", "[rack1*2&rack2*4]"), "partition=gpu-large_2.a",
                                                "account=proj-123", "qos=high_prio", "gpu_type=h100",
                                                "env={NCCL_DEBUG: INFO, _X1: 'a b'}"])
    script = render(spec)
    for line in ("#SBATCH --constraint=[rack1*2&rack2*4]", "#SBATCH --partition=gpu-large_2.a",
                 "#SBATCH --account=proj-123", "#SBATCH --qos=high_prio", "#SBATCH --gpus-per-node=h100:8",
                 "export _X1='a b'"):
        assert line in script.splitlines()
    assert load_spec("tiny_cpu", ["constraint=(a|b)&c", "time=2-00:00:00"]).constraint == "(a|b)&c"
    with pytest.raises(errors.UsageError, match=r"container.mounts.0: .*no ','"):
        load_spec("tiny_cpu", ["container={image: img, mounts: ['/a,/etc:/b']}"])


@pytest.mark.parametrize("field", FREE_TRAIN + FREE_SHARD)
def test_a_line_break_or_nul_in_a_free_value_is_refused_naming_the_field(field, tmp_path):
    base = "imagenet21k_shard" if field in FREE_SHARD else "tiny_cpu"
    for value in (f"x\ntouch {tmp_path / 'pwned'}", "x\ry", "x\x00y"):
        with pytest.raises(errors.UsageError) as e:
            load_spec(base, [_set(field, value)])
        named = f"{field}.0" if field in LISTS else field
        assert f"{named}: {value!r}: " in str(e.value) and "control character" in str(e.value), (value, str(e.value))


def mount(text: str) -> str:
    return f"/a {text.replace(',', '')}:/b"  # pyxis splits mounts at commas: one is refused


def test_hostile_free_values_render_as_exact_shell_words_and_a_complete_sbatch_block(tmp_path):
    text = hostile(tmp_path / "pwned")
    spec = load_spec("tiny_cpu", [_set("log_dir", f"{tmp_path}/logs {text}"), _set("venv", f"{tmp_path}/venv {text}"),
                                  f"env={json.dumps({'VF_VALUE': text})}", _set("train.config", f"cfg {text}"),
                                  _set("train.overrides", f"data.note={text}"), _set("train.dataset", f"s3://b/{text}"),
                                  _set("train.checkpoint_dir", f"{tmp_path}/ck {text}"),
                                  f"container={json.dumps({'image': f'img {text}', 'mounts': [mount(text)]})}"])
    script = render(spec)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    lines = script.splitlines()
    assert shlex.split(next(x for x in lines if x.startswith("export VF_VALUE="))) == ["export", f"VF_VALUE={text}"]
    assert shlex.split(next(x for x in lines if x.startswith("source "))) == ["source", f"{spec.venv}/bin/activate"]
    exit_file = next(x for x in lines if x.startswith("export VITFORGE_EXIT_FILE="))
    assert shlex.split(exit_file.replace('"$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"', "7-0")) == \
        ["export", f"VITFORGE_EXIT_FILE={spec.log_dir}/.exit-7-0"]  # only the job id and restart are expanded
    start = script.index("\nsrun ") + 1
    srun = script[start:script.index("\n", script.index("\\\n", start) + 2)]
    words = shlex.split(srun.replace("\\\n", " "))  # bash's line continuation
    assert words[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=2"]
    assert words[3:5] == [f"--container-image=img {text}", f"--container-mounts={mount(text)}"]
    assert words[5:] == trainer_command(spec)
    block = sbatch_block(script)
    assert block[-4:-1] == ["#SBATCH --requeue", "#SBATCH --signal=USR1@60", "#SBATCH --open-mode=append"]
    assert block[-1].startswith("#SBATCH --output=") and len(block) == 9


def test_hostile_shard_values_render_as_exact_shell_words(tmp_path):
    text = hostile(tmp_path / "pwned")
    spec = load_spec("imagenet21k_shard", [_set("shard.src", f"s3://b/{text}"),
                                           _set("shard.dest", f"{tmp_path}/d {text}"),
                                           f"shard.args={json.dumps(['--shard-bytes', text])}",
                                           _set("log_dir", f"{tmp_path}/logs {text}"),
                                           f"env={json.dumps({'VF_VALUE': text})}"])
    for script, command in ((render_shard_array(spec), ["vitforge", "shard", spec.shard.src, spec.shard.dest]),
                            (render_merge(spec), ["vitforge", "shard", "merge", spec.shard.dest])):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        words = shlex.split(next(x for x in script.splitlines() if x.startswith("vitforge shard")))
        assert words[:len(command)] == command
        if "merge" not in command:
            assert words[-4:] == ["--shard-bytes", text, "--part", "$SLURM_ARRAY_TASK_ID"]
        assert shlex.split(next(x for x in script.splitlines() if x.startswith("export VF_VALUE="))) == \
            ["export", f"VF_VALUE={text}"]
        assert sbatch_block(script)[-1].startswith("#SBATCH --output=")


def _job_info(job: str) -> dict:
    deadline = time.monotonic() + 180
    while True:
        info = slurm_commands.job_info(job)
        if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def _hostile_venv(tmp_path: Path, text: str) -> Path:
    """A virtualenv folder with a hostile name whose activate script is the real one's."""
    venv = Path(f"{tmp_path}/venv {text}")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f"source {shlex.quote(str(REPO / '.venv' / 'bin' / 'activate'))}\n")
    return venv


def test_a_real_job_runs_hostile_values_as_data_and_refuses_hostile_names(slurm, monkeypatch, tmp_path):
    """One training job whose every free value carries the payload (from the YAML file and from
    --set): it runs to the end of its script with the whole #SBATCH block, its log where log_dir
    says, the trainer gets the config path it was given, and no payload runs. Then one submit
    whose SLURM names all carry payloads is refused with exit 2 naming each, writing nothing."""
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    mark = tmp_path / "pwned"
    text = hostile(mark)
    log_dir = Path(f"{tmp_path}/logs {text}")
    config = f"{tmp_path}/config {text}.yaml"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "inj-train", "nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
        "time": "00:10:00", "signal_lead_s": 60, "max_requeues": 0, "log_dir": str(log_dir),
        "venv": str(_hostile_venv(tmp_path, text)), "env": {"VF_VALUE": text}, "train": {"config": config}}))
    out = vitforge("submit", spec, "--set", _set("train.overrides", f"data.note={text}"),
                   "--set", _set("train.dataset", f"{tmp_path}/data {text}"),
                   "--set", _set("train.checkpoint_dir", f"{tmp_path}/ck {text}")).stdout
    job = out.split("submitted job ")[1].split(":")[0]
    info = _job_info(job)
    log = log_dir / f"inj-train-{job}.out"
    text_log = log.read_text() if log.exists() else ""
    assert not mark.exists(), "a payload ran"
    assert info["JobState"] == "FAILED" and info["Requeue"] == "1" and info["TimeLimit"] == "00:10:00", info
    assert f"vitforge: job {job} ended" in text_log and "with exit code 2" in text_log, text_log[-2000:]
    assert f"{config}: no such config file" in text_log  # the trainer got its argument unchanged
    assert not list(log_dir.glob(".exit-*"))  # the exit file was written and read back where log_dir says
    block = sbatch_block((log_dir / "inj-train.sbatch").read_text())
    assert {"#SBATCH --requeue", "#SBATCH --signal=USR1@60"} <= set(block)
    assert block[-1].startswith("#SBATCH --output=")

    names = {"name": f"x$(touch {mark})", "partition": "debug\ntouch " + str(mark), "account": f"acct\ntouch {mark}",
             "qos": f"q;touch {mark}", "constraint": f"a&&touch {mark}", "gpu_type": f"`touch {mark}`",
             "time": "00:10:00\n", "mem_per_cpu": "1G; touch " + str(mark)}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(spec.read_text()), "log_dir": str(tmp_path / "bad-logs"),
                                   **{k: v for k, v in names.items() if k not in ("qos", "constraint")}}))
    key = f"A=1; touch {mark}; B"
    refusal = vitforge("submit", bad, "--set", _set("qos", names["qos"]),
                       "--set", _set("constraint", names["constraint"]),
                       "--set", f"env={json.dumps({key: '1'})}", check=False)
    assert refusal.returncode == errors.USAGE, refusal.stderr
    for field, value in [*names.items(), (f"env.{key}.[key]", key)]:
        assert f"{field}: {value!r}: " in refusal.stderr, (field, refusal.stderr)
    assert not (tmp_path / "bad-logs").exists() and not mark.exists()


def test_a_real_sharding_array_and_merge_take_hostile_paths_as_data(small_corpus, slurm, monkeypatch, tmp_path):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    mark = tmp_path / "pwned"
    text = hostile(mark)
    src = Path(f"{tmp_path}/src {text}")
    src.parent.mkdir(parents=True)
    src.symlink_to(small_corpus)
    dest, log_dir = Path(f"{tmp_path}/dest {text}"), Path(f"{tmp_path}/logs {text}")
    spec = tmp_path / "shard.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "inj-shard", "gpus_per_node": 0, "cpus_per_task": 1, "time": "00:10:00", "log_dir": str(log_dir),
        "venv": str(_hostile_venv(tmp_path, text)), "env": {"VF_VALUE": text},
        "shard": {"src": str(src), "dest": str(dest), "num_parts": 1, "args": ["--shard-samples", "64"]}}))
    out = vitforge("submit", spec).stdout
    array, merge = (line.split(" ")[3].rstrip(":") for line in out.splitlines())
    info = _job_info(merge)
    assert not mark.exists(), "a payload ran"
    assert info["JobState"] == "COMPLETED", (info, [p.read_text() for p in log_dir.glob("*.out")])
    assert json.loads((dest / "dataset.json").read_text())["totals"]["samples"] == 120
    assert (log_dir / f"inj-shard-{array}_0.out").exists() and (log_dir / f"inj-shard-merge-{merge}.out").exists()
