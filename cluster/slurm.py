"""Talking to SLURM through its own commands (sbatch, scontrol, scancel): nothing is mocked, and
every failure names the command and what it said."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from vitforge.core import UsageError, VitforgeError, errors

from .spec import slurm_seconds


class SlurmError(VitforgeError):
    exit_code = errors.STORAGE
    kind = "slurm error"


def _run(command: list[str], input_text: str | None = None) -> str:
    if shutil.which(command[0]) is None:
        raise UsageError(f"{command[0]}: not found; run this on a SLURM login node (or install slurm-client)")
    result = subprocess.run(command, capture_output=True, text=True, input=input_text)
    if result.returncode != 0:
        raise SlurmError(f"{' '.join(command[:2])}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def submit(script_path: str, after_ok: str | None = None) -> str:
    """sbatch a script (to start only once job `after_ok` succeeded, every array task of it);
    return the job id."""
    dependency = [f"--dependency=afterok:{after_ok}"] if after_ok else []
    return _run(["sbatch", "--parsable", *dependency, script_path]).strip().split(";")[0]


# The states of a job that will not run again (SLURM's own names); CONFIGURING, COMPLETING,
# REQUEUED and the like pass.
JOB_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def job_info(job: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, StdOut, ...). Older SLURMs
    name the requeue count RestartCnt; it is given as Restarts either way."""
    return parse_job_info(_run(["scontrol", "show", "job", "-o", str(job)]))


# `scontrol show job -o` prints KEY=VALUE pairs separated by spaces, and a value (StdOut, WorkDir,
# Command, a job name) may hold spaces itself: a value runs up to the next " KEY=". Keys are words,
# with ':' and '/' inside some (NtasksPerN:B:S:C, Socks/Node).
_PAIR = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)", re.DOTALL)


def parse_job_info(text: str) -> dict[str, str]:
    """What `scontrol show job -o` printed, as job_info gives it."""
    info = dict(_PAIR.findall(text.strip()))
    info.setdefault("Restarts", info.get("RestartCnt", "0"))
    return info


def cancel(job: str, signal: str | None = None) -> None:
    _run(["scancel", *([f"--signal={signal}"] if signal else []), str(job)])


def log_path(job: str) -> str:
    info = job_info(job)
    return os.path.expandvars(info.get("StdOut", ""))


def partition_limits(partition: str | None) -> dict | None:
    """The limits of a partition (the default one when None) as sinfo reports them, or None when no
    partition of that name is known."""
    return parse_partitions(_run(["sinfo", "-h", "-o", "%P|%l|%G"]), partition)


def parse_partitions(sinfo: str, partition: str | None) -> dict | None:
    """{"name", "gpus_per_node": {GRES type or None: most GPUs on one node}, "max_time_s"} from
    `sinfo -h -o %P|%l|%G`, which prints a line per distinct node configuration of a partition and
    GRES as gpu:8, gpu:h100:8(S:0-1), gpu:a100:4,gpu:h100:4 or (null). max_time_s: None if unlimited."""
    found: dict | None = None
    for line in sinfo.splitlines():
        name, limit, gres = [*line.split("|"), "", ""][:3]
        default = name.endswith("*")
        name = name.rstrip("*")
        if not ((partition is None and default) or name == partition):
            continue
        found = found or {"name": name, "gpus_per_node": {}, "max_time_s": _seconds(limit)}
        on_node: dict[str | None, int] = {}
        for gpu_type, count in re.findall(r"(?:^|,)gpu(?::([^:,(]+))?:(\d+)", gres):
            on_node[gpu_type or None] = on_node.get(gpu_type or None, 0) + int(count)
        typed = sum(n for t, n in on_node.items() if t is not None)
        if typed:  # an untyped request takes GPUs of any type
            on_node[None] = on_node.get(None, 0) + typed
        for gpu_type, count in on_node.items():
            found["gpus_per_node"][gpu_type] = max(found["gpus_per_node"].get(gpu_type, 0), count)
    return found


def _seconds(limit: str) -> int | None:
    return None if limit in ("infinite", "UNLIMITED", "n/a", "") else slurm_seconds(limit)
