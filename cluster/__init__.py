"""Cluster launch for multi-node GPU runs: launch specs rendered to sbatch scripts, submission,
the preemption-requeue loop, and a capacity planner (`vitforge plan`)."""

from .local_slurm import local_slurm_missing, start_local_slurm, stop_local_slurm
from .plan import PlanInput, plan, report
from .render import render, trainer_command
from .slurm import cancel, job_info
from .spec import LaunchSpec, SpecError, load_spec

__all__ = ["LaunchSpec", "PlanInput", "SpecError", "cancel", "job_info", "load_spec", "local_slurm_missing", "plan",
           "render", "report", "start_local_slurm", "stop_local_slurm", "trainer_command"]
