"""The launcher seam: how a launch spec becomes jobs on a cluster, and how a job is followed and
stopped. `vitforge submit`, `status`, `logs` and `cancel` speak only this protocol; SLURM is the one
implementation. A Kubernetes or SkyPilot launcher is another class with these methods and a line in
`LAUNCHERS`: the trainer knows no launcher (it reads its place from vitforge.core's scheduler table and
exits with the requeue code), so nothing there changes.

Imports no torch: this runs on a login node.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Protocol

from vitforge.core import UsageError, registry

from . import slurm
from .render import render, render_merge, render_shard_array
from .spec import LaunchSpec, check_against


class Script(NamedTuple):
    """One job to submit: its file name (in the spec's log_dir), its text, what it is (for the user),
    and its log's file name with "{job}" standing for the job id the launcher gives it."""

    file_name: str
    text: str
    kind: str
    log: str


class Launcher(Protocol):
    name: str

    def scripts(self, spec: LaunchSpec, parts: list[int] | None = None) -> list[Script]:
        """The jobs a spec runs as, in submission order; each after the first waits for the first to
        succeed. `parts`: a sharding spec's parts to run (all when None)."""

    def check(self, spec: LaunchSpec) -> None:
        """Refuse (SpecError) a spec the cluster cannot run, before anything is written or submitted."""

    def submit(self, script_path: str, after_ok: str | None = None) -> str:
        """Submit a script (to start once job `after_ok` succeeded); return its job id."""

    def parse_job(self, text: str) -> str:
        """A job id as this launcher takes it, or ValueError saying what one looks like."""

    def status(self, job: str) -> dict[str, str | None]:
        """job, name, state, reason, restarts, exit_code, log (None where the cluster does not say)."""

    def cancel(self, job: str, signal: str | None = None) -> None:
        """Cancel a job, or send it `signal` (a name without SIG, e.g. USR1) instead."""

    def log_path(self, job: str) -> str:
        """Where the job's output is written."""


class SlurmLauncher:
    """sbatch scripts, through SLURM's own commands (vitforge.cluster.slurm)."""

    name = "slurm"

    def scripts(self, spec: LaunchSpec, parts: list[int] | None = None) -> list[Script]:
        if spec.shard:
            return [
                Script(
                    f"{spec.name}.sbatch",
                    render_shard_array(spec, parts),
                    "job array",
                    f"{spec.name}-{{job}}_<task>.out",
                ),
                Script(f"{spec.name}-merge.sbatch", render_merge(spec), "merge job", f"{spec.name}-merge-{{job}}.out"),
            ]
        return [Script(f"{spec.name}.sbatch", render(spec), "job", f"{spec.name}-{{job}}.out")]

    def check(self, spec: LaunchSpec) -> None:
        check_against(spec, slurm.partition_limits(spec.partition))

    def submit(self, script_path: str, after_ok: str | None = None) -> str:
        return slurm.submit(script_path, after_ok)

    def parse_job(self, text: str) -> str:
        # 1234, an array task 1234_7, a het-job component 1234+1: what scontrol and scancel take
        if not re.fullmatch(r"\d+([_+]\d+)?", text):
            raise ValueError(f"{text!r} is not a SLURM job id (e.g. 1234 or 1234_7)")
        return text

    def status(self, job: str) -> dict[str, str | None]:
        info = slurm.job_info(job)
        return {
            "job": info.get("JobId"),
            "name": info.get("JobName"),
            "state": info.get("JobState"),
            "reason": info.get("Reason"),
            "restarts": info["Restarts"],
            "exit_code": info.get("ExitCode"),
            "log": info.get("StdOut"),
        }

    def cancel(self, job: str, signal: str | None = None) -> None:
        slurm.cancel(job, signal)

    def log_path(self, job: str) -> str:
        return slurm.log_path(job)


LAUNCHERS: dict[str, type | str] = {"slurm": SlurmLauncher}  # name -> class, or "module:class" (core/registry.py)
DEFAULT_LAUNCHER = "slurm"


def get_launcher(name: str = DEFAULT_LAUNCHER) -> Launcher:
    """The launcher registered as `name`; a UsageError listing the known ones otherwise."""
    launcher = registry.find(
        LAUNCHERS, name, unknown=lambda known: UsageError(f"unknown launcher {name!r}; known: {', '.join(known)}")
    )
    return launcher()
