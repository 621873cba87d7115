"""`vitforge demo`'s training stage: a tiny ViT with ZeRO-2 on 2 CPU ranks, through a private local
SLURM (when its daemons are installed and this is root) or 2 rank processes started directly;
SIGUSR1 a third of the way in, then the run resumes from the store. Its progress is printed from
metrics.jsonl, and the trainer's own log lines say where it stopped and what it resumed from."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from vitforge.cluster import JOB_ENDED, cancel, job_info
from vitforge.core import errors, free_port

from .demo_stages import Demo, DemoError

RUN = "demo"


def _training_overrides(demo: Demo) -> list[str]:
    steps = demo.steps
    return [
        f"data.train={demo.facts['train']}",
        f"data.val={demo.facts['val']}",
        "data.backend=dali-cpu",
        "data.workers=1",
        f"checkpoint.dir={demo.facts['store']}/runs",
        f"checkpoint.run={RUN}",
        f"checkpoint.log_dir={demo.path('logs')}",
        f"train.steps={steps}",
        f"train.eval_every={max(steps // 6, 1)}",
        f"train.checkpoint_every={max(steps // 2, 1)}",
        f"train.log_every={max(steps // 60, 1)}",
        "train.zero_stage=2",
        "model.name=vit_tiny_cpu",
    ]


def train(demo: Demo):
    from vitforge.testing import local_slurm_missing

    slurm_why = None
    if demo.launcher != "direct":
        slurm_why = local_slurm_missing()
        if slurm_why and demo.launcher == "slurm":
            raise DemoError(f"--launcher slurm: {slurm_why}")
    use_slurm = demo.launcher == "slurm" or (demo.launcher == "auto" and slurm_why is None)
    how = "a private local SLURM" if use_slurm else f"2 rank processes started directly ({slurm_why or 'asked'})"
    demo.say(
        f"train a tiny ViT, ZeRO-2 on 2 CPU processes, through {how}; SIGUSR1 a third of the way in, "
        "then resume from the store"
    )
    demo.facts.update(
        run=f"{demo.facts['store']}/runs/{RUN}", launcher="slurm" if use_slurm else "direct", launcher_why=slurm_why
    )
    if use_slurm:
        return _train_slurm(demo)
    _train_direct(demo)
    return None


def _metrics(demo: Demo) -> list[dict]:
    path = demo.path("logs", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Progress:
    """Prints the new lines of metrics.jsonl once each: every evaluation, a tenth of the log lines."""

    def __init__(self, demo: Demo):
        self.demo, self.every, self.next = demo, max(demo.steps // 10, 1), 1
        self.shown: set[tuple[int, bool]] = set()  # (step, a training line) printed already

    def step(self) -> int:
        latest = 0
        for m in _metrics(self.demo):
            latest = max(latest, m["step"])
            key = (m["step"], "loss" in m)
            if key in self.shown:
                continue
            self.shown.add(key)
            if "loss" in m and m["step"] >= self.next:
                self.next = m["step"] + self.every
                print(
                    f"  step {m['step']:4d}  loss {m['loss']:.3f}  {m['images_per_s']:.0f} images/s  "
                    f"data wait {100 * m['data_wait_fraction']:.0f}%",
                    flush=True,
                )
            elif "eval_top1" in m:
                print(f"  step {m['step']:4d}  held-out top-1 {100 * m['eval_top1']:.1f}%", flush=True)
        return latest


def _wait_for_step(progress: Progress, step: int, ended, timeout: float = 900) -> None:
    """Poll the metrics often (a tiny model takes a few seconds for the second half of its run),
    and now and then whether the training has ended: `ended()` says how, or None while it runs."""
    checked = time.monotonic()
    deadline = checked + timeout
    while progress.step() < step:
        if time.monotonic() - checked > 5:
            if how := ended():
                raise DemoError(f"training ended before the demo could interrupt it at step {step}: {how}")
            checked = time.monotonic()
        if time.monotonic() > deadline:
            raise DemoError(f"training did not reach step {step} in {timeout:.0f} s")
        time.sleep(0.1)


def _train_direct(demo: Demo) -> None:
    """What srun does, by hand: 2 rank processes; SIGUSR1 to each, as SLURM sends it; then again."""
    progress = Progress(demo)
    command = ["train", "tiny_cpu"] + [a for o in _training_overrides(demo) for a in ("--set", o)]
    print("$ RANK=0,1 WORLD_SIZE=2 ... vitforge " + shlex.join(command), flush=True)
    logs: list[str] = []
    os.makedirs(demo.path("logs"), exist_ok=True)
    for attempt in (1, 2):
        ranks = _start_ranks(demo, command, attempt, logs)
        if attempt == 1:
            _wait_for_step(progress, demo.steps // 3, functools.partial(_ranks_exited, ranks, logs))
            print(f"  sending SIGUSR1 to both ranks at step {progress.step()} (as a preemption would)", flush=True)
            for r in ranks:
                r.send_signal(signal.SIGUSR1)
        while any(r.poll() is None for r in ranks):
            progress.step()
            time.sleep(0.5)
        codes = [r.returncode for r in ranks]
        wanted = errors.REQUEUE if attempt == 1 else errors.OK
        if codes != [wanted, wanted]:
            raise DemoError(f"attempt {attempt}: the ranks exited {codes}, expected {wanted}; logs: {', '.join(logs)}")
        if attempt == 1:
            print(
                "  both ranks saved a checkpoint to the store and exited 75 (requeue me); starting them again",
                flush=True,
            )
    progress.step()
    _record_resume(demo, "".join(Path(p).read_text() for p in logs), logs)


def _start_ranks(demo: Demo, command: list[str], attempt: int, logs: list[str]) -> list[subprocess.Popen]:
    """One attempt's 2 rank processes, with the variables torchrun would set, each logging to a file
    of its own (added to `logs`)."""
    port = free_port()
    ranks = []
    for rank in range(2):
        log_path = demo.path("logs", f"train-attempt{attempt}-rank{rank}.log")
        logs.append(log_path)
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        with open(log_path, "w") as log:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-m", "vitforge", *command], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
    return ranks


def _ranks_exited(ranks: list[subprocess.Popen], logs: list[str]) -> str | bool:
    """How the ranks ended once either has, for `_wait_for_step` (False while both run)."""
    return (
        any(r.poll() is not None for r in ranks)
        and f"the ranks exited {[r.poll() for r in ranks]}; logs: {', '.join(logs)}"
    )


def _train_slurm(demo: Demo):
    from vitforge.testing import start_local_slurm, stop_local_slurm

    slurm_env = start_local_slurm(demo.path("slurm"))
    os.environ.update(slurm_env)
    print(f"slurmctld and slurmd up on localhost (SLURM_CONF={slurm_env['SLURM_CONF']})")
    try:
        progress = Progress(demo)
        overrides = "[" + ", ".join(_training_overrides(demo)) + "]"
        venv = ["--set", f"venv={sys.prefix}"] if sys.prefix != sys.base_prefix else []
        submitted = demo.vitforge(
            "submit",
            "tiny_cpu",
            "--set",
            "name=vitforge-demo",
            "--set",
            f"log_dir={demo.path('slurm-logs')}",
            *venv,
            "--set",
            f"train.overrides={overrides}",
        )
        job = submitted.stdout.split("submitted job ")[1].split(":")[0]
        log_path = demo.path("slurm-logs", f"vitforge-demo-{job}.out")
        _wait_for_step(progress, demo.steps // 3, lambda: _job_ended(job, log_path))
        # In this process: a command's start-up (about 2 s on a busy machine) is a tenth of the run.
        print(
            f"  step {progress.step()}: sending SIGUSR1 to the job, as a preemption or its time limit would "
            f"(`vitforge cancel {job} --signal USR1`)",
            flush=True,
        )
        cancel(job, "USR1")
        deadline = time.monotonic() + 900
        while (state := _job_state(job))[0] not in JOB_ENDED:
            if time.monotonic() > deadline:
                raise DemoError(f"job {job} did not finish in 15 minutes: {state}")
            progress.step()
            time.sleep(1)
        progress.step()
        log = demo.vitforge("logs", job, quiet=True).stdout
        if state[0] != "COMPLETED":
            raise DemoError(f"job {job} ended {state[0]}; its log {log_path}:\n{log[-3000:]}")
        print(f"  job {job} COMPLETED after {state[1]} requeue(s)", flush=True)
        demo.facts.update(job=job, requeues=state[1])
        _record_resume(demo, log, [log_path])
    except BaseException:
        stop_local_slurm(slurm_env)
        raise
    return lambda: stop_local_slurm(slurm_env)


def _job_ended(job: str, log_path: str) -> str | None:
    """How a job ended (its state and the end of its log), or None while it may still run."""
    state = _job_state(job)[0]
    if state not in JOB_ENDED:
        return None
    tail = Path(log_path).read_text()[-3000:] if os.path.exists(log_path) else "(no log)"
    return f"job {job} is {state}; its log {log_path} ends:\n{tail}"


def _job_state(job: str) -> tuple[str, int]:
    """(state, restarts) of a job, straight from scontrol: polled often, it must be quick."""
    info = job_info(job)
    return info.get("JobState", "UNKNOWN"), int(info["Restarts"])


def _record_resume(demo: Demo, log: str, logs: list[str]) -> None:
    """The trainer's own words: where it stopped (and why), and which checkpoint it resumed from."""
    stopped = re.search(r"stopped at step (\d+) \(([^)]*)\)", log)
    resumed = re.search(rf"resumed ({re.escape(demo.facts['run'])}/step_\d+) at step (\d+)", log)
    if not stopped or not resumed:
        raise DemoError(f"the run was not stopped and resumed from the store as planned; logs: {', '.join(logs)}")
    demo.facts.update(
        stop_step=int(stopped.group(1)),
        stop_reason=stopped.group(2),
        resumed_from=resumed.group(1),
        resume_step=int(resumed.group(2)),
        train_logs=logs,
        metrics=_metrics(demo),
    )
    print(
        f"  stopped at step {stopped.group(1)} ({stopped.group(2)}) with a complete checkpoint; resumed from "
        f"{resumed.group(1)} at step {resumed.group(2)}",
        flush=True,
    )
