"""The hang watchdog: a rank frozen mid-run under a real SLURM is named, every live rank's stacks
reach RUN/debug/, the job exits 76, requeues and completes; the timeout's sizing; the sbatch
loop's bounded hang requeues (its tail run with a stand-in scontrol); PyTorch's NCCL watchdog
variables in GPU scripts only."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from common.cli import vitforge
from test_cluster import _submit, _wait
from vitforge.cluster import load_spec, render
from vitforge.core import SchedulerEnv, errors, record_exit_code
from vitforge.trainer import ConfigError, RunStore, load_config, tag_for
from vitforge.trainer import watchdog as watchdog_module
from vitforge.trainer.watchdog import Watchdog, auto_timeout

STEPS = 100
TIMEOUT_S = 5


def _first_incarnation_rank(job: str, rank: int) -> int | None:
    """The pid of `rank`'s trainer in the job's first incarnation (SLURM's task environment says which)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in item)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if (env.get("SLURM_JOB_ID") == job and env.get("SLURM_PROCID") == str(rank)
                and env.get("SLURM_RESTART_COUNT", "0") == "0" and len(cmd) > 2
                and cmd[1].endswith(b"/vitforge") and cmd[2] == b"train"):
            return int(proc.name)
    return None


@pytest.mark.slow(seconds=65)
def test_a_frozen_rank_is_named_and_the_job_requeues_and_completes(data, slurm, monkeypatch, tmp_path):
    """Rank 1 of the first incarnation is SIGSTOPped mid-run: within the timeout plus the grace
    period rank 0's stacks are in RUN/debug/, the log names rank 1 and its host as not reaching
    the collective, the incarnation ends with exit code 76 and requeues, and the next one completes
    the run."""
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    job = _submit(data, tmp_path, "hang", steps=STEPS, extra=f", train.hang_timeout_s={TIMEOUT_S}")
    run = data / "runs" / "hang"
    deadline = time.monotonic() + 300
    pid = None
    while time.monotonic() < deadline:  # a few steps in: the watchdog is armed after the first
        metrics = run / "metrics.jsonl"
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if steps and max(steps) >= 3:
            pid = _first_incarnation_rank(job, 1)
            break
        time.sleep(0.05)
    assert pid is not None, (vitforge("logs", job).stdout[-3000:])
    os.kill(pid, signal.SIGSTOP)
    frozen, frozen_at = time.monotonic(), time.time()
    while not list((run / "debug").glob("*-rank0-*.txt")) and time.monotonic() - frozen < 60:
        time.sleep(0.1)  # py-spy symbolising libtorch may take many seconds of a loaded machine
    stacks = list((run / "debug").glob("*-rank0-*.txt"))
    assert stacks, vitforge("logs", job).stdout[-3000:]
    text = stacks[0].read_text()
    fired = datetime.fromisoformat(re.search(r"fired at (\S+)", text).group(1)).timestamp()
    assert fired - frozen_at < TIMEOUT_S + 10, (fired - frozen_at, text[:500])  # the timeout runs from the last beat
    final = _wait(job)
    log = (tmp_path / f"hang-{job}.out").read_text()
    host = socket.gethostname()
    assert final["state"] == "COMPLETED" and final["restarts"] == 1, (final, log[-4000:])
    assert f"did not reach the collective (no watchdog report: frozen, dead or cut off): rank 1 (host {host})" in log
    assert f"vitforge: job {job} hung (hang 1; at most 2 requeued)" in log  # rank 0's exit code was 76
    assert f"vitforge: requeueing job {job} (restart 0)" in log
    assert (tmp_path / f".hangs-{job}").read_text().strip() == "1"
    assert f"rank 0 (host {host}" in text and f"did not finish within {TIMEOUT_S} s" in text
    assert "Current thread" in text and "trainer/train.py" in text  # every thread's stack, the main one's too
    assert "last_enqueued_collective" in text  # the flight recorder's view of the collectives
    assert "py-spy dump --native" in text and "Python v" in text  # py-spy (a dev dependency): native frames too
    assert RunStore(str(run)).latest() == tag_for(STEPS)


def test_the_timeout_is_sized_from_the_step_time_never_under_the_floor_nor_past_collectives():
    assert auto_timeout([], 300, 540) == 300
    assert auto_timeout([0.5] * 10, 300, 540) == 300
    assert auto_timeout([20.0] * 5 + [900.0] * 2, 300, 540) == 400  # 20 x the median: slow outliers move nothing
    assert auto_timeout([60.0] * 5, 300, 540) == 540  # capped: before the collectives give up
    assert auto_timeout([60.0] * 5, 300, 9) == 300  # never under the floor
    assert Watchdog(7, 300, 600).timeout() == 7  # train.hang_timeout_s as given, floor or not
    watchdog = Watchdog(None, 30, 600, {"checkpoint save": 100})
    assert watchdog.overdue(time.monotonic() + 1e6) is None  # start-up and the first step are not guarded
    watchdog.beat(1)
    watchdog.times.extend([2.0] * 10)
    assert watchdog.timeout() == 40
    assert watchdog.overdue(watchdog.progress.last + 39) is None
    assert watchdog.overdue(watchdog.progress.last + 41) == ("step 2", 2, 40)
    with watchdog.phase("checkpoint save"):  # its own allowance on top
        start = watchdog.progress.phase[1]
        assert watchdog.overdue(start + 139) is None
        assert watchdog.overdue(start + 141) == ("checkpoint save after step 1", 1, 140)
    assert watchdog.progress.last > start and watchdog.overdue(watchdog.progress.last + 39) is None  # from its end
    with watchdog.phase("evaluation"):  # the first: at least the floor on top
        assert watchdog.overdue(watchdog.progress.phase[1] + 71) == ("evaluation after step 1", 1, 70)
    watchdog.longest["evaluation"] = 50.0  # as if that one had lasted 50 s
    with watchdog.phase("evaluation"):  # later ones: three times the longest so far on top
        assert watchdog.overdue(watchdog.progress.phase[1] + 189) is None
        assert watchdog.overdue(watchdog.progress.phase[1] + 191) == ("evaluation after step 1", 1, 190)
    watchdog.beat(2)  # the time from a phase's end to the next beat is no step time
    assert len(watchdog.times) == 10


def test_the_watchdog_must_expire_before_a_collective_gives_up():
    for key in ("hang_timeout_s", "hang_floor_s"):
        with pytest.raises(ConfigError, match=rf"train.{key} \(600\) must be below train.collective_timeout_s \(600\)"):
            load_config("tiny_cpu", [f"train.{key}=600"])
    load_config("tiny_cpu", ["train.hang_timeout_s=600", "train.watchdog=false"])  # no watchdog, no limit
    assert load_config("tiny_cpu", ["train.collective_timeout_s=8"]).train.hang_floor_s == 300  # the default: no check


def test_a_rank_that_finds_rank_0_stuck_records_the_hang_and_the_first_verdict_stands(monkeypatch, tmp_path, caplog):
    """Rank 0, frozen, writes no exit code: rank 1, finding its store unreachable, writes 76 so
    that the job requeues as hung; a later writer does not overwrite it."""
    verdict = tmp_path / ".exit-7-0"
    monkeypatch.setenv("VITFORGE_EXIT_FILE", str(verdict))
    monkeypatch.setattr(watchdog_module, "STORE_S", 1.0)  # how long rank 1 waits for the store
    watchdog = Watchdog(None, 30, 600)
    with socket.socket() as frozen:  # as a SIGSTOPped rank 0's store: the kernel accepts, nothing answers
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()
        watchdog.env = SchedulerEnv("slurm", 1, 2, 0, "127.0.0.1", frozen.getsockname()[1])
        watchdog.master_host = "node0"
        started = time.monotonic()
        assert watchdog._connect() is None and time.monotonic() - started < 5
    assert verdict.read_text() == f"{errors.HUNG}\n" and "rank 0 is the one stuck" in caplog.text
    assert not record_exit_code(errors.REQUEUE, claim=True) and verdict.read_text() == f"{errors.HUNG}\n"


def _loop(script: str, tmp_path: Path, code: int, restart: int, slurm_restarts: int | None = None):
    """The script's tail after srun, with rank 0's verdict `code` in the exit file and a stand-in
    scontrol that reports `slurm_restarts` (default: this incarnation) and records requeues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/bash\nif [ "$1" = requeue ]; then echo "$2" >> "$REQUEUED"; '
                        'else echo "JobId=$SLURM_JOB_ID Restarts=$SLURM_RESTARTS"; fi\n')
    scontrol.chmod(0o755)
    exit_file = tmp_path / f".exit-7-{restart}"
    exit_file.write_text(f"{code}\n")
    tail = script[script.index("code=$?"):]
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_RESTART_COUNT": str(restart), "SLURM_RESTARTS": str(restart if slurm_restarts is None else
                                                                      slurm_restarts),
           "VITFORGE_EXIT_FILE": str(exit_file), "REQUEUED": str(tmp_path / "requeued")}
    done = subprocess.run(["bash", "-c", f"set -uo pipefail\n(exit 143)\n{tail}"], env=env, capture_output=True,
                          text=True, timeout=30)
    requeued = (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []
    (tmp_path / "requeued").unlink(missing_ok=True)
    return done.returncode, done.stdout, requeued


def test_the_loop_requeues_a_hang_a_bounded_number_of_times(tmp_path):
    script = render(load_spec("tiny_cpu", [f"log_dir={tmp_path}", "max_hang_requeues=1", "max_requeues=3"]))
    code, out, requeued = _loop(script, tmp_path, errors.HUNG, 0)
    assert (code, requeued) == (0, ["7"]) and "hung (hang 1; at most 1 requeued)" in out, out
    code, out, requeued = _loop(script, tmp_path, errors.HUNG, 1, slurm_restarts=2)  # a stale copy: no count
    assert (code, requeued) == (errors.HUNG, []) and "is stale" in out, out
    code, out, requeued = _loop(script, tmp_path, errors.REQUEUE, 1)  # 75 does not count as a hang
    assert (code, requeued) == (0, ["7"]), out
    code, out, requeued = _loop(script, tmp_path, errors.HUNG, 2)
    assert (code, requeued) == (errors.HUNG, []) and "hang requeue limit 1 reached" in out, out
    assert "exit code 76" in out and (tmp_path / ".hangs-7").read_text().strip() == "2"
    code, out, requeued = _loop(script, tmp_path, errors.REQUEUE, 3)  # max_requeues still bounds everything
    assert (code, requeued) == (errors.REQUEUE, []) and "requeue limit 3 reached" in out, out


def test_pytorch_nccl_watchdog_variables_only_in_gpu_scripts(tmp_path):
    assert "TORCH_NCCL" not in render(load_spec("tiny_cpu"))
    script = render(load_spec("vit_h14_pretrain_1node", [f"log_dir={tmp_path}",
                                                         "env={TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: '1200'}"]))
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    shown = subprocess.run(["bash", "-c", f"{exports}\nenv"], env={"SLURM_JOB_ID": "7", "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert {"TORCH_NCCL_TRACE_BUFFER_SIZE=2000", "TORCH_NCCL_DUMP_ON_TIMEOUT=1", "TORCH_NCCL_ENABLE_MONITORING=1",
            f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={tmp_path}/nccl-trace-7-0-rank",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1200"} <= set(shown)  # the spec's env wins
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=600" in script
