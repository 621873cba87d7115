"""Cluster launch for multi-node GPU runs: launch specs rendered to sbatch scripts, a Launcher
(SLURM today) that submits them, the preemption-requeue loop, and a capacity planner (`vitforge plan`)."""

from vitforge.core.lazy import lazy_exports

from .launcher import LAUNCHERS, Launcher, Script, SlurmLauncher, get_launcher
from .render import eval_command, render, trainer_command
from .slurm import JOB_ENDED, cancel, job_info
from .spec import LaunchSpec, SpecError, load_spec

__all__ = [
    "JOB_ENDED",
    "LAUNCHERS",
    "LaunchSpec",
    "Launcher",
    "PlanInput",
    "Script",
    "SlurmLauncher",
    "SpecError",
    "cancel",
    "eval_command",
    "get_launcher",
    "job_info",
    "load_spec",
    "plan",
    "render",
    "report",
    "trainer_command",
]

# The planner builds models (torch, timm: seconds to import); `vitforge submit`, `status` and
# `logs` on a login node never need it, so it is imported on first use only.
__getattr__ = lazy_exports(__name__, globals(), {"planner": ("PlanInput", "plan"), "planner_report": ("report",)})
