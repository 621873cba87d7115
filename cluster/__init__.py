"""Cluster launch for multi-node GPU runs. So far: the capacity planner (`vitforge plan`); SLURM
specs, submission and the requeue loop arrive with the rest of issue 8."""

from .plan import PlanInput, plan, report

__all__ = ["PlanInput", "plan", "report"]
