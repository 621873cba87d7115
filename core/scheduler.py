"""Where this process sits in its job, read from the scheduler's environment: the one place that knows
the variables of torchrun (and the deepspeed launcher), SLURM's srun, and a plain single process.

`SCHEDULERS` is an ordered table of (name, detect, read), tried in order the way Lightning's cluster
environments are: the first row whose `detect(environ)` holds reads the process's place. A launcher's
own RANK/WORLD_SIZE win over SLURM's (torchrun inside a SLURM allocation numbers the ranks itself);
a plain process is rank 0 of 1. The job (its id, restart count, array task) is SLURM's whenever a
SLURM job surrounds the process, whichever row numbered the ranks. Adding a scheduler is one row.

Imports no torch: a login node's `vitforge submit` and a sharding task read it too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .errors import UsageError

DEFAULT_MASTER_ADDR = "127.0.0.1"
TORCHRUN_DEFAULT_PORT = 29500
# SLURM jobs sharing a node must not share a rendezvous port: one from the job id, in 20000..39999.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class SchedulerEnv:
    """This process's place. Per rank: a few numbers and strings, read once from its environment."""

    scheduler: str  # the row that matched: "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int  # 0: none given (a single process), bind any free port
    # Ranks per node; the ranks of node n are n*L .. n*L+L-1 (torchrun's numbering, and srun's block
    # distribution, the default). 1 when the launcher does not say.
    local_world_size: int = 1
    job: str | None = None  # "slurm:1234", an array task "slurm:1234_7"; None outside a scheduler's job
    restart_count: int = 0  # how often the scheduler requeued this job (SLURM_RESTART_COUNT)
    array_index: int | None = None  # this task's place in its job array, from 0; None outside an array


class Scheduler(NamedTuple):
    name: str
    detect: Callable[[Mapping[str, str]], bool]
    read: Callable[[Mapping[str, str]], SchedulerEnv]


def _whole(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A non-negative whole number from `name`; unset or empty gives `default` (required when None)."""
    text = env.get(name, "")
    if text == "" and default is not None:
        return default
    if not text.isdigit():
        raise UsageError(f"{name}={text!r} is not a whole number")
    return int(text)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as 'gpu[07-09,12],cpu1' (what `scontrol show hostnames`
    prints first)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot read SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_job(env: Mapping[str, str]) -> dict:
    """The SLURM job around this process, whoever numbered its ranks. A job keeps its id across
    requeues; an array task is named ARRAYJOB_TASK, as scontrol and scancel take it."""
    job, task = env.get("SLURM_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    array_index = None if not task else _whole(env, "SLURM_ARRAY_TASK_ID") - _whole(env, "SLURM_ARRAY_TASK_MIN", 0)
    if job and task:
        job = f"{env.get('SLURM_ARRAY_JOB_ID', job)}_{task}"
    return {
        "job": f"slurm:{job}" if job else None,
        "restart_count": _whole(env, "SLURM_RESTART_COUNT", 0),
        "array_index": array_index,
    }


def _check_rank(env: SchedulerEnv, rank_var: str, size_var: str) -> SchedulerEnv:
    if env.world_size < 1 or env.rank >= env.world_size:
        raise UsageError(f"{rank_var}={env.rank} is not a rank of {size_var}={env.world_size}")
    return env


def _read_torchrun(env: Mapping[str, str]) -> SchedulerEnv:
    return _check_rank(
        SchedulerEnv(
            "torchrun",
            _whole(env, "RANK"),
            _whole(env, "WORLD_SIZE"),
            _whole(env, "LOCAL_RANK", 0),
            env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
            _whole(env, "MASTER_PORT", TORCHRUN_DEFAULT_PORT),
            _whole(env, "LOCAL_WORLD_SIZE", 1),
            **_slurm_job(env),
        ),
        "RANK",
        "WORLD_SIZE",
    )


def _read_slurm(env: Mapping[str, str]) -> SchedulerEnv:
    job_id = _whole(env, "SLURM_JOB_ID", 0)
    per_node_var = "SLURM_NTASKS_PER_NODE" if env.get("SLURM_NTASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    per_node = env.get(per_node_var) or "1"
    count = re.match(r"\d+", per_node)  # SLURM_TASKS_PER_NODE reads like "8(x2),4"
    if not count:
        raise UsageError(f"{per_node_var}={per_node!r} does not start with a number of tasks")
    return _check_rank(
        SchedulerEnv(
            "slurm",
            _whole(env, "SLURM_PROCID"),
            _whole(env, "SLURM_NTASKS"),
            _whole(env, "SLURM_LOCALID", 0),
            env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", DEFAULT_MASTER_ADDR)),
            _whole(env, "MASTER_PORT", SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN),
            int(count.group()),
            **_slurm_job(env),
        ),
        "SLURM_PROCID",
        "SLURM_NTASKS",
    )


def _read_single(env: Mapping[str, str]) -> SchedulerEnv:
    return SchedulerEnv("single", 0, 1, 0, DEFAULT_MASTER_ADDR, 0, 1, **_slurm_job(env))


SCHEDULERS: tuple[Scheduler, ...] = (
    Scheduler("torchrun", lambda env: "RANK" in env and "WORLD_SIZE" in env, _read_torchrun),
    Scheduler("slurm", lambda env: "SLURM_PROCID" in env and "SLURM_NTASKS" in env, _read_slurm),
    Scheduler("single", lambda env: True, _read_single),
)


def scheduler_env(environ: Mapping[str, str] | None = None) -> SchedulerEnv:
    """The first row of `SCHEDULERS` that detects `environ` (default: this process's), read. A value
    that is not what its scheduler writes is a UsageError naming the variable."""
    env = os.environ if environ is None else environ
    return next(row.read(env) for row in SCHEDULERS if row.detect(env))
