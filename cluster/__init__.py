"""Cluster launch for multi-node GPU runs: launch specs rendered to sbatch scripts, submission,
the preemption-requeue loop, and a capacity planner (`vitforge plan`)."""

from .plan import PlanInput, plan, report
from .render import render, trainer_command
from .spec import LaunchSpec, SpecError, load_spec

__all__ = ["LaunchSpec", "PlanInput", "SpecError", "load_spec", "plan", "render", "report", "trainer_command"]
