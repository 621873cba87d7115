"""Cluster launch for multi-node GPU runs: launch specs rendered to sbatch scripts, submission,
the preemption-requeue loop, and a capacity planner (`vitforge plan`)."""

import importlib

from .local_slurm import LOCAL_SLURM_SETTINGS, local_slurm_missing, start_local_slurm, stop_local_slurm
from .render import eval_command, render, trainer_command
from .slurm import cancel, job_info
from .spec import LaunchSpec, SpecError, load_spec

__all__ = ["LOCAL_SLURM_SETTINGS", "LaunchSpec", "PlanInput", "SpecError", "cancel", "eval_command", "job_info",
           "load_spec", "local_slurm_missing", "plan", "render", "report", "start_local_slurm", "stop_local_slurm",
           "trainer_command"]
PLANNER = ("PlanInput", "plan", "report")


def __getattr__(name: str):
    # The planner builds models (torch, timm: seconds to import); `vitforge submit`, `status` and
    # `logs` on a login node never need it, so it is imported on first use only.
    if name in PLANNER:
        planner = importlib.import_module(".planner", __name__)
        globals().update({n: getattr(planner, n) for n in PLANNER})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
