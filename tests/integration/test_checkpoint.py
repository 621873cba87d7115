"""Checkpoints in object storage: exact resume through faults, kill -9, corruption, preemption,
ownership, retention, export, and the failures that must be one clear line.

Real DeepSpeed ZeRO-2 across 2 processes (gloo on CPU), the SeaweedFS S3 server on 127.0.0.1
behind the fault proxy, and plain local folders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.checks import SECRET, assert_same_weights, losses, weights
from common.cli import EXTENSIONS, REPO, STRAIGHT, start_ranks, train, train_args, vitforge
from vitforge.core import errors

@pytest.mark.slow(seconds=85)
def test_s3_save_and_resume_through_faults_is_exact(data, straight, s3_server, bucket, faulty, monkeypatch,
                                                    tmp_path):
    env, schedule = faulty
    store = f"s3://{bucket}/runs"
    logs = tmp_path / "logs"
    first = train(data, "s3run", *STRAIGHT, "train.stop_at=12", f"checkpoint.log_dir={logs}", store=store, env=env)
    second = train(data, "s3run", *STRAIGHT, f"checkpoint.log_dir={logs}", store=store, env=env)
    assert "at step 12" in second.stderr and f"{store}/s3run/step_00000012" in second.stderr
    assert sum(schedule.injected.values()) >= 3, schedule.injected  # faults really happened, and were survived
    assert losses(logs) == losses(straight)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_same_weights(weights(f"{store}/s3run"), weights(str(straight)))
    listing = vitforge("ckpt", "list", f"{store}/s3run", env=env)
    assert "step_00000024 <- latest" in listing.stdout and "incomplete" not in listing.stdout
    assert vitforge("ckpt", "verify", f"{store}/s3run", env=env).returncode == 0
    client = s3_server["client"]
    manifest = json.loads(client.get_object(Bucket=bucket, Key="runs/s3run/step_00000024/manifest.json")["Body"].read())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == 2 and manifest["num_classes"] == 10
    assert "rank1_state.pt" in manifest["files"] and manifest["classes"][0] == "class_00"
    everything = first.stdout + first.stderr + second.stdout + second.stderr + json.dumps(manifest)
    assert SECRET not in everything


@pytest.mark.slow(seconds=65)
def test_kill_9_at_any_point_resumes_from_the_newest_complete_checkpoint(data, straight, s3_server, bucket,
                                                                         tmp_path, monkeypatch):
    """Killed while an upload is in flight (a slow link), then killed mid-training: each rerun
    resumes from the newest complete checkpoint, never from a partial one, and ends equal."""
    from common.faulty_proxy import FaultSchedule, start_proxy

    schedule = FaultSchedule(0, 0, 0, latency_s=0.15)
    server, port = start_proxy(int(s3_server["endpoint"].rsplit(":", 1)[1]), schedule)
    slow = {**s3_server["env"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    store, logs = f"s3://{bucket}/runs", tmp_path / "logs"
    client = s3_server["client"]

    def keys() -> set[str]:
        return {o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="runs/k9/")
                for o in page.get("Contents", [])}

    def uploading() -> bool:
        names = keys()
        folders = {k.split("/")[2] for k in names if k.split("/")[2].startswith("step_")}
        return any(f"runs/k9/{f}/manifest.json" not in names for f in folders)

    def logged(step: int) -> bool:
        path = logs / "metrics.jsonl"
        return path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines())

    for env, killed_when in ((slow, uploading), ({**s3_server["env"]}, lambda: logged(15))):
        process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
             str(_port()), "-m", "vitforge", "train",
             *train_args(data, "k9", *STRAIGHT, f"checkpoint.log_dir={logs}", store=store)],
            cwd=REPO, env={**os.environ, **EXTENSIONS, **env}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 240
        while not killed_when() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    server.shutdown()
    before = vitforge("ckpt", "list", f"{store}/k9", env=s3_server["env"]).stdout
    newest = max(int(line.split()[0]) for line in before.splitlines()[1:] if " complete " in line)
    final = train(data, "k9", *STRAIGHT, f"checkpoint.log_dir={logs}", store=store, env=s3_server["env"])
    assert f"at step {newest}" in final.stderr
    assert losses(logs) == losses(straight)  # stale steps past the restored checkpoint were dropped
    for key, value in s3_server["env"].items():
        monkeypatch.setenv(key, value)
    assert_same_weights(weights(f"{store}/k9"), weights(str(straight)))
    after = vitforge("ckpt", "list", f"{store}/k9", env=s3_server["env"]).stdout
    assert "incomplete" not in after
    assert not [k for k in keys() if k.startswith("runs/k9/.tmp")]
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix="runs/k9/").get("Uploads", [])
    assert uploads == []


def _port() -> int:
    from vitforge.core import free_port

    return free_port()


@pytest.mark.slow
def test_corrupt_or_incomplete_checkpoints_are_refused_before_loading(data, straight):
    run = Path(shutil.copytree(straight, data / "runs" / "corrupt"))  # a finished run's copy to damage
    optim = run / "step_00000024" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data_bytes = bytearray(optim.read_bytes())
    data_bytes[len(data_bytes) // 2:len(data_bytes) // 2 + 16] = os.urandom(16)
    optim.write_bytes(bytes(data_bytes))
    (run / "step_00000018" / "manifest.json").write_text('{"step": 18, "files": {truncated')
    check = vitforge("ckpt", "verify", run, check=False)
    assert check.returncode == errors.CHECK_FAILED
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: sha256 differs" in check.stdout
    assert "step_00000018/manifest.json: not valid JSON" in check.stdout
    assert "step_00000012: OK" in check.stdout
    resumed = train(data, "corrupt", *STRAIGHT)
    assert "sha256 differs from the manifest" in resumed.stderr and "falling back to step_00000018" in resumed.stderr
    assert "not valid JSON" in resumed.stderr and "falling back to step_00000012" in resumed.stderr
    assert "at step 12" in resumed.stderr and "Traceback" not in resumed.stderr
    assert losses(run) == losses(straight)  # nothing corrupt was loaded: the run ends as it did
    assert vitforge("ckpt", "verify", run).returncode == 0  # the re-saved 18 and 24 are whole again


@pytest.mark.slow
def test_only_this_runs_own_consistent_checkpoints_are_resumed(data, straight):
    """A manifest whose step was edited, a checkpoint copied in from another run (its id differs),
    a setting a run keeps from its start changed: each is passed over with a warning, or refused
    naming both sides when asked for by name or when it would change the experiment. A setting
    that may change (the schedule's length) is allowed, logged and recorded in later manifests."""
    run = Path(shutil.copytree(straight, data / "runs" / "identity"))
    edited = json.loads((run / "step_00000024" / "manifest.json").read_text())
    (run / "step_00000024" / "manifest.json").write_text(json.dumps({**edited, "step": 999}))
    foreign = json.loads((run / "step_00000018" / "manifest.json").read_text())
    mine = foreign["run_id"]
    (run / "step_00000018" / "manifest.json").write_text(json.dumps({**foreign, "run_id": "0ther"}))
    check = vitforge("ckpt", "verify", run, check=False)
    assert check.returncode == errors.CHECK_FAILED
    assert "step_00000024/manifest.json: says step 999, but its folder is step_00000024" in check.stdout
    assert f"belongs to run 0ther (checkpoint.run 'straight'), not to this run, {mine}" in check.stdout
    assert "step_00000012: OK" in check.stdout
    named = train(data, "identity", *STRAIGHT, "checkpoint.resume=18", check=False)
    assert named.returncode == errors.CHECKPOINT and "belongs to run 0ther" in named.stderr, named.stderr[-3000:]
    batch = edited["config"]["train"]["global_batch"]
    changed = train(data, "identity", *STRAIGHT, f"train.global_batch={2 * batch}", check=False)
    assert changed.returncode == errors.USAGE, changed.stderr[-3000:]
    assert f"train.global_batch: {batch} in the checkpoint, {2 * batch} now" in changed.stderr
    assert "falling back to step_00000018" in changed.stderr and "falling back to step_00000012" in changed.stderr
    longer = train(data, "identity", *[o for o in STRAIGHT if not o.startswith("train.steps=")], "train.steps=30")
    assert "at step 12" in longer.stderr and "Traceback" not in longer.stderr
    # (data.train may be recorded too: `straight` may have been trained by another xdist worker's data copy)
    assert "with changed settings: " in longer.stderr and "train.steps 24 -> 30" in longer.stderr
    saved = json.loads((run / "step_00000030" / "manifest.json").read_text())
    [record] = saved["changed_on_resume"]
    assert record["step"] == 12 and record["settings"]["train.steps"] == [24, 30]
    assert set(record["settings"]) <= {"train.steps", "data.train", "data.val"}, record
    assert saved["run_id"] == mine and saved["step"] == 30


@pytest.mark.slow
def test_sigusr1_to_one_rank_saves_and_exits_for_requeue(data, straight, tmp_path):
    ranks = start_ranks(data, "usr1", *STRAIGHT)
    deadline = time.monotonic() + 120
    # The handler is installed before anything slow: signal as soon as rank 1 is up.
    while not (data / "runs" / "usr1" / "lease.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    ranks[1].send_signal(signal.SIGUSR1)
    time.sleep(0.05)
    ranks[1].send_signal(signal.SIGUSR1)  # a second signal during the save changes nothing
    outputs = [r.communicate(timeout=240) for r in ranks]
    assert [r.returncode for r in ranks] == [errors.REQUEUE, errors.REQUEUE], outputs
    stopped = outputs[0][1]
    assert "stopped for requeue: stopped at step" in stopped and "another rank was signalled" in stopped
    step = int(stopped.split("stopped at step ")[1].split()[0])
    assert (data / "runs" / "usr1" / "latest").read_text() == f"step_{step:08d}"
    assert (data / "runs" / "usr1" / f"step_{step:08d}" / "manifest.json").exists()
    resumed = train(data, "usr1", *STRAIGHT)
    assert f"at step {step}" in resumed.stderr
    assert losses(data / "runs" / "usr1") == losses(straight)
    assert_same_weights(weights(str(data / "runs" / "usr1")), weights(str(straight)))


def _signal_during_start_up(ranks, run, children: bool) -> set[str]:
    """SIGUSR1 every 0.3 s to each rank (and, like SLURM, to all its descendants when `children`)
    from the moment the ranks hold the signal until start-up is over (the lease is taken) or they
    exit; returns the names of the descendants signalled. (The CLI holds the signals from its first
    line, about 0.1 s after exec; before that a signal still kills the process.)"""
    import psutil

    held = (1 << (signal.SIGUSR1 - 1)) | (1 << (signal.SIGTERM - 1))
    deadline = time.monotonic() + 30
    while not all(_blocked_signals(r.pid) & held == held for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.005)
    signalled = set()
    deadline = time.monotonic() + 240
    # Until every rank is gone: a rank left unsignalled would build the op itself and then wait out
    # the rendezvous for the peer that already left.
    while not (run / "lease.json").exists() and time.monotonic() < deadline and any(r.poll() is None for r in ranks):
        for rank in ranks:
            try:
                family = [psutil.Process(rank.pid)]
                family += family[0].children(recursive=True) if children else []
                for process in family:
                    process.send_signal(signal.SIGUSR1)
                    signalled |= {process.name()} if process.pid != rank.pid else set()
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.3)
    return signalled


@pytest.mark.slow
def test_a_signal_during_start_up_stops_the_run_after_its_first_step(data, straight):
    run = data / "runs" / "held"
    ranks = start_ranks(data, "held", *STRAIGHT)
    _signal_during_start_up(ranks, run, children=False)
    outputs = [r.communicate(timeout=240) for r in ranks]
    assert [r.returncode for r in ranks] == [errors.REQUEUE, errors.REQUEUE], outputs[0][1][-3000:]
    assert "stopped at step 1 (signal SIGUSR1)" in outputs[0][1]
    assert (run / "latest").read_text() == "step_00000001"
    train(data, "held", *STRAIGHT)
    assert losses(run) == losses(straight)
    assert_same_weights(weights(str(run)), weights(str(straight)))


def test_a_run_past_its_time_budget_saves_and_exits_for_requeue(data):
    """train.max_minutes (what a job script derives from its time limit and signal lead) stops the
    run as a signal would: the budget, counted from start-up, is spent before the first step ends."""
    result = train(data, "budget", *STRAIGHT, "train.max_minutes=0.001", nproc=1, check=False)
    assert result.returncode == errors.REQUEUE, result.stderr[-3000:]
    assert "stopped at step 1 (train.max_minutes reached)" in result.stderr
    run = data / "runs" / "budget"
    assert (run / "latest").read_text() == "step_00000001" and (run / "step_00000001" / "manifest.json").exists()


@pytest.mark.slow(seconds=95)
def test_a_signal_that_kills_a_start_up_child_still_ends_in_a_requeue(data, tmp_path):
    """With an empty extensions folder, start-up JIT-compiles DeepSpeed's shm op: ninja holds the
    signal it inherits, but starts its compilers with an empty mask, and they die of it. The ranks
    exit for requeue (nothing was trained), not with an internal error, naming both causes."""
    run = data / "runs" / "held_cold"
    ranks = start_ranks(data, "held_cold", *STRAIGHT, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})
    signalled = _signal_during_start_up(ranks, run, children=True)
    outputs = [r.communicate(timeout=240) for r in ranks]
    assert "ninja" in signalled, signalled  # the compiler really ran and was signalled
    assert [r.returncode for r in ranks] == [errors.REQUEUE, errors.REQUEUE], outputs[0][1][-3000:]
    assert "stopped for requeue: signal SIGUSR1 came during start-up, which then failed (RuntimeError: Error " \
           "building extension 'deepspeed_shm_comm'" in outputs[0][1]
    assert not (run / "latest").exists() and not (run / "lease.json").exists()


def _blocked_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("SigBlk:")[1].split()[0], 16)


@pytest.mark.slow
def test_a_second_job_is_refused_and_sigterm_stops_the_first(data):
    first = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
         "-m", "vitforge", "train", *train_args(data, "owned", "train.steps=5000", "data.val=null",
                                                "train.checkpoint_every=1000")],
        cwd=REPO, env={**os.environ, **EXTENSIONS}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lease = data / "runs" / "owned" / "lease.json"
    deadline = time.monotonic() + 120
    while not lease.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    holder = json.loads(lease.read_text())
    second = vitforge("train", *train_args(data, "owned", "train.steps=5000", "data.val=null"), env=EXTENSIONS,
                      check=False)
    assert second.returncode == errors.STORAGE
    assert f"{data / 'runs' / 'owned'} is in use by job {holder['job']}" in second.stderr
    assert "Traceback" not in second.stderr
    assert len([line for line in second.stderr.splitlines() if line.startswith("vitforge:")]) == 1
    first.send_signal(signal.SIGTERM)  # torchrun forwards it to the ranks
    _, stderr = first.communicate(timeout=240)
    assert "stopped at step" in stderr and "signal SIGTERM" in stderr
    assert json.loads(lease.read_text())["state"] == "released"  # the requeued job (or anyone) may continue at once


@pytest.mark.slow
def test_retention_keeps_the_newest_and_every_kth(data):
    train(data, "keep", "train.steps=12", "train.checkpoint_every=2", "checkpoint.keep_last=2",
          "checkpoint.keep_every=4", "data.val=null")
    kept = sorted(p.name for p in (data / "runs" / "keep").glob("step_*"))
    assert kept == ["step_00000004", "step_00000008", "step_00000010", "step_00000012"]


@pytest.mark.slow
def test_export_loads_in_timm_and_eval_needs_no_training_data(data, straight, tmp_path):
    from safetensors.torch import load_file

    from vitforge.pipeline import LoaderSpec, build_loader
    from vitforge.trainer import build_model

    out = tmp_path / "model.safetensors"
    exported = json.loads(vitforge("ckpt", "export", straight, "--out", out).stdout.strip().splitlines()[-1])
    description = json.loads((tmp_path / "model.json").read_text())
    assert description["model"] == "vit_tiny_cpu" and description["num_classes"] == 10
    assert description["classes"][3] == "class_03" and description["image_size"] == 32 == exported["image_size"]
    model = build_model(description["model"], description["num_classes"], description["image_size"]).eval()
    model.load_state_dict(load_file(out), strict=True)
    evaluated = vitforge("eval", "tiny_cpu", "--checkpoint", straight, "--set", "data.train=/deleted/train",
                         "--set", f"data.val={data / 'val'}", "--set", "data.backend=torch", "--set", "data.workers=0",
                         env=EXTENSIONS)
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    loader = build_loader(LoaderSpec(str(data / "val"), batch_size=16, image_size=32, train=False, backend="torch",
                                     workers=0))
    total, hits, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in loader:
            valid = batch["label"] >= 0
            logits, labels = model(batch["image"])[valid], batch["label"][valid]
            total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            hits += (logits.argmax(1) == labels).sum().item()
            count += len(labels)
    assert count == result["eval_samples"] == 100
    assert hits / count == result["eval_top1"] and abs(total / count - result["eval_loss"]) < 1e-5
    wrong = vitforge("eval", "tiny_cpu", "--checkpoint", straight, "--set", f"data.val={data / 'val'}",
                     "--set", "model.num_classes=12", "--set", "data.backend=torch", env=EXTENSIONS, check=False)
    assert wrong.returncode == errors.CHECKPOINT
    assert "parameter head.weight has shape (10, 64) in the checkpoint but (12, 64)" in wrong.stderr
    assert "Traceback" not in wrong.stderr


@pytest.mark.slow
def test_non_finite_loss_stops_before_any_checkpoint_of_it(data):
    ranks = start_ranks(data, "nan", "optimizer.lr=1e30", "optimizer.warmup_steps=0", "optimizer.grad_clip=0",
                        "train.steps=20", "train.checkpoint_every=1", "data.val=null")
    outputs = [r.communicate(timeout=240)[1] for r in ranks]
    assert [r.returncode for r in ranks] == [errors.DIVERGED, errors.DIVERGED], outputs
    assert "vitforge: diverged: step" in outputs[0] and "not finite" in outputs[0]
    bad_step = int(outputs[0].split("diverged: step ")[1].split(":")[0])
    saved = [int(p.name.split("_")[1]) for p in (data / "runs" / "nan").glob("step_*")]
    assert saved and max(saved) < bad_step
    assert "Traceback" not in outputs[0] + outputs[1]


@pytest.mark.parametrize("override, message, code", [
    ("model.name=vit_nonexistent_patch16", "model.name: unknown model 'vit_nonexistent_patch16'", errors.USAGE),
    ("checkpoint.dir=nosuch://bucket/runs", "no store for nosuch:// (a local folder, or one of", errors.USAGE),
    ("checkpoint.dir=hdfs://bucket/runs", "hdfs:// is read through fsspec, which offers no all-or-nothing write",
     errors.USAGE),
    ("checkpoint.dir=s3:///runs", "no bucket in the s3:// URL", errors.USAGE),
    ("train.steps=-5", "train.steps: Input should be greater than or equal to 1", errors.USAGE),
    ("train.checkpoint_every=0", "train.checkpoint_every: Input should be greater than or equal to 1", errors.USAGE),
    ("checkpoint.dir=/etc/hostname/runs", "/etc/hostname", errors.STORAGE),
])
@pytest.mark.slow
def test_failures_are_one_line_with_a_documented_code(data, override, message, code):
    result = vitforge("train", *train_args(data, "bad", override), env=EXTENSIONS, check=False)
    assert result.returncode == code, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("vitforge:")]) == 1


@pytest.mark.slow
def test_unreachable_store_fails_fast_naming_the_url(data):
    env = {**EXTENSIONS, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    start = time.monotonic()
    result = vitforge("train", *train_args(data, "far", store="s3://somewhere/runs"), env=env, check=False)
    assert result.returncode == errors.STORAGE and "s3://somewhere/runs/far" in result.stderr
    assert time.monotonic() - start < 90 and "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_a_node_fetches_only_the_universal_files_its_ranks_read():
    from vitforge.trainer.checkpoint_files import universal_files

    files = dict.fromkeys(f"universal/{name}" for name in (
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/a.weight/fp32.pt",
        "zero/a.weight/exp_avg.pt", "zero/b.bias/fp32.pt", "zero/b.bias/step.pt"))
    shared = ["universal/mp_rank_00_model_states.pt", "universal/zero/optimizer_state.pt",
              "universal/zero_pp_rank_0_mp_rank_00_model_states.pt"]  # DeepSpeed never opens rank 1's copy
    assert universal_files(files, {"a.weight"}) == sorted(shared + ["universal/zero/a.weight/exp_avg.pt",
                                                                    "universal/zero/a.weight/fp32.pt"])
    assert universal_files(files, None) == sorted(set(files) - {"universal/zero_pp_rank_1_mp_rank_00_model_states.pt"})


def test_denials_are_not_retried_and_throttling_is():
    from botocore.exceptions import ClientError

    from vitforge.core import StorageError, with_retries
    from vitforge.core.store_s3 import _named

    def failing(code: str, status: int):
        calls = []

        def call():
            calls.append(1)
            with _named("s3://b/key"):
                raise ClientError({"Error": {"Code": code, "Message": "m"},
                                   "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        return call, calls

    call, calls = failing("SignatureDoesNotMatch", 403)
    with pytest.raises(StorageError, match="s3://b/key: SignatureDoesNotMatch"):
        with_retries(call, "get s3://b/key", base_delay=0.001)
    assert len(calls) == 1
    call, calls = failing("SlowDown", 503)
    with pytest.raises(StorageError, match="failed after 3 attempts"):
        with_retries(call, "get s3://b/key", attempts=3, base_delay=0.001)
    assert len(calls) == 3


@pytest.mark.slow(seconds=60)
def test_resume_from_s3_at_another_world_size(data, straight, s3_server, bucket, monkeypatch, tmp_path):
    """Saved by 2 ranks (ZeRO-2) to s3://, resumed by 1: every file is fetched and checked, converted
    with ds_to_universal in staging, the result published beside the checkpoint (its marker last)
    for any later resume at another world size, and training continues to the same end: the same
    samples and, to float tolerance (1 rank sums the micro-batches in another order), the losses and
    weights of the uninterrupted 2-rank run. (ZeRO-3: test_trainer.)"""
    store, logs = f"s3://{bucket}/runs", tmp_path / "logs"
    common = [*STRAIGHT, f"checkpoint.log_dir={logs}"]
    train(data, "s3ws", *common, "train.stop_at=12", store=store, env=s3_server["env"])
    moved = train(data, "s3ws", *common, store=store, env=s3_server["env"], nproc=1)
    assert "to a universal checkpoint" in moved.stderr and "at step 12" in moved.stderr
    assert sorted(losses(logs)) == list(range(1, 25))
    keys = {o["Key"] for o in s3_server["client"].list_objects_v2(Bucket=bucket, Prefix="runs/s3ws/")["Contents"]}
    marker = json.loads(s3_server["client"].get_object(Bucket=bucket, Key="runs/s3ws/step_00000012/universal.json")
                        ["Body"].read())
    assert {f"runs/s3ws/step_00000012/{name}" for name in marker["files"]} == \
        {k for k in keys if "universal/" in k} and "runs/s3ws/step_00000012/universal/zero/optimizer_state.pt" in keys
    assert {k.split("/")[2] for k in keys if "universal" in k} == {"step_00000012"}  # saved at 1: nothing to convert
    for key, value in s3_server["env"].items():
        monkeypatch.setenv(key, value)
    assert json.loads(s3_server["client"].get_object(Bucket=bucket, Key="runs/s3ws/step_00000024/manifest.json")
                      ["Body"].read())["world_size"] == 1
    moved_losses, reference = losses(logs), losses(straight)
    assert all(abs(moved_losses[s] - reference[s]) < 1e-3 for s in reference), (reference, moved_losses)
    a, b = weights(f"{store}/s3ws"), weights(str(straight))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-3


@pytest.mark.slow
def test_two_nodes_train_from_s3_through_their_own_shard_caches_like_a_local_run(data, straight, s3_server, bucket,
                                                                                tmp_path):
    """torchrun on 2 "nodes" of 1 rank (its --nnodes/--node_rank give each process its node), the
    training shards in S3: each node fetches its own partition's shards into its own cache folder,
    and the run trains exactly like the 2-rank run from the local folder."""
    client = s3_server["client"]
    for path in sorted((data / "train").iterdir()):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"train/{path.name}", Body=path.read_bytes())
    port, logs, cache = str(_port()), tmp_path / "logs", tmp_path / "cache"
    args = train_args(data, "twonodes", *STRAIGHT, f"checkpoint.log_dir={logs}", f"data.train=s3://{bucket}/train",
                      f"data.cache_dir={cache}")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                               "-m", "vitforge", "train", *args],
                              cwd=REPO, env={**os.environ, **EXTENSIONS, **s3_server["env"]}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert losses(logs) == losses(straight)
    cached = [{p.name.rsplit("-", 2)[0] for p in (cache / f"node{n}").glob("*/*.tar-*")
               if not p.name.endswith((".lock", ".partial"))} for n in range(2)]
    shards = {p.name for p in (data / "train").glob("*.tar")}
    assert cached[0] and cached[1] and cached[0] | cached[1] == shards
    assert len(cached[0] & cached[1]) <= 1  # only a shard cut between the two nodes' partitions is in both
