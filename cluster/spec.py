"""Launch specs: one validated schema for a multi-node SLURM training job, YAML files in
cluster/specs/ plus `--set a.b=c` overrides, like the trainer's config."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vitforge.core import UsageError
from vitforge.core.settings import load_validated

SPECS = Path(__file__).resolve().parent / "specs"
# Names that carry credentials: never written into a script; jobs get them from the environment
# they are submitted from (sbatch exports it) or from a credentials file the cluster has.
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|PRIVATE|SESSION", re.IGNORECASE)
TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")
MEMORY = re.compile(r"^\d+[KMGT]?$")  # SLURM's size form: megabytes, or a K/M/G/T suffix


class SpecError(UsageError):
    kind = "spec error"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class Container(Strict):
    image: str
    """A container image for pyxis/enroot (srun --container-image)."""
    mounts: list[str] = []
    """SRC:DST mounts (srun --container-mounts)."""


class TrainJob(Strict):
    config: str
    """A trainer recipe name or YAML path, as `vitforge train` takes it."""
    overrides: list[str] = []
    """KEY=VALUE trainer overrides (`--set`), e.g. [train.steps=1000]."""
    dataset: str | None = None
    """Sets data.train."""
    checkpoint_dir: str | None = None
    """Sets checkpoint.dir (s3:// for runs that survive any node)."""


class ShardArray(Strict):
    src: str
    """What `vitforge shard` takes: class folders or a manifest, local or s3://."""
    dest: str
    """The dataset's folder or s3:// prefix."""
    num_parts: int = Field(ge=1)
    """One array task per part; a dependent job merges them into dataset.json."""
    throttle: int | None = Field(None, ge=1)
    """At most this many parts at once (--array=...%N)."""
    args: list[str] = []
    """More `vitforge shard` options, e.g. [--shard-bytes, 1GiB, --max-side, "512"]."""


class LaunchSpec(Strict):
    name: str
    """The job's name (letters, digits, '_', '.', '-')."""
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=0)
    tasks_per_node: int | None = Field(None, ge=1)
    """Default: one task (rank) per GPU, 1 without GPUs."""
    cpus_per_task: int = Field(8, ge=1)
    """CPU cores per rank (decode workers run on them)."""
    mem_per_node: str | None = None
    """SLURM's --mem, e.g. "900G". Give at most one memory request; none: the partition's default."""
    mem_per_cpu: str | None = None
    """SLURM's --mem-per-cpu, e.g. "8G": scales with cpus_per_task x tasks."""
    mem_per_gpu: str | None = None
    """SLURM's --mem-per-gpu, e.g. "110G"."""
    gpu_type: str | None = None
    """A GRES type, e.g. "h100": requests --gpus-per-node=h100:8."""
    time: str = "04:00:00"
    """The time limit, D-HH:MM:SS (SLURM's forms); the trainer stops itself signal_lead_s before it."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    """A node feature, e.g. "h100"."""
    exclusive: bool = False
    """Whole nodes only."""
    container: Container | None = None
    """Run the ranks in a container (pyxis/enroot)."""
    venv: str | None = None
    """A virtualenv to activate on every node."""
    env: dict[str, str] = {}
    """Variables exported in the script; credentials are refused (the job inherits them instead)."""
    nccl: Literal["none", "infiniband", "efa", "roce"] = "none"
    """The interconnect's NCCL settings."""
    train: TrainJob | None = None
    """A training job (give exactly one of train and shard)."""
    shard: ShardArray | None = None
    """A sharding job array plus a dependent merge job."""
    max_requeues: int = Field(10, ge=0)
    """Self-requeues after a stop signal or time budget, at most."""
    signal_lead_s: int = Field(180, ge=10)
    """SIGUSR1 this long before the time limit (--signal=USR1@N): time to save and requeue."""
    log_dir: str = "slurm-logs"
    """The job logs' folder (%x-%j.out)."""

    @field_validator("name")
    @classmethod
    def _job_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
            raise ValueError(f"{value!r}: letters, digits, '_', '.', '-' only")
        return value

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not TIME.match(value):
            raise ValueError(f"{value!r}: expected a SLURM time such as 04:00:00 or 2-00:00:00")
        return value

    @field_validator("mem_per_node", "mem_per_cpu", "mem_per_gpu")
    @classmethod
    def _slurm_size(cls, value: str | None) -> str | None:
        if value is not None and not MEMORY.match(value):
            raise ValueError(f"{value!r}: expected a SLURM size such as 900G, 64000 (MB) or 2T")
        return value

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        secret = sorted(k for k in value if SECRET_NAME.search(k))
        if secret:
            raise ValueError(f"{', '.join(secret)}: credentials are never written into a job script; export them "
                             "where you run `vitforge submit` (sbatch passes the environment on) or use the "
                             "cluster's credentials file")
        return value

    @model_validator(mode="after")
    def _one_job(self):
        if (self.train is None) == (self.shard is None):
            raise ValueError("give exactly one of train: or shard:")
        memory = [k for k in ("mem_per_node", "mem_per_cpu", "mem_per_gpu") if getattr(self, k) is not None]
        if len(memory) > 1:
            raise ValueError(f"{' and '.join(memory)}: give at most one (SLURM takes one memory request)")
        if self.mem_per_gpu and not self.gpus_per_node:
            raise ValueError("mem_per_gpu: the spec requests no GPUs (gpus_per_node is 0)")
        if self.gpu_type and not self.gpus_per_node:
            raise ValueError("gpu_type: the spec requests no GPUs (gpus_per_node is 0)")
        return self

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or max(self.gpus_per_node, 1)

    def time_limit_s(self) -> int:
        """SLURM's forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
        return slurm_seconds(self.time)


def slurm_seconds(text: str) -> int:
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        hours, minutes, seconds = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    return (int(days or 0) * 24 + hours) * 3600 + minutes * 60 + seconds


def check_against(spec: LaunchSpec, limits: dict | None) -> None:
    """An impossible request is an error before anything is submitted."""
    where = spec.partition or "the default partition"
    if limits is None:
        raise SpecError(f"partition {where!r}: SLURM knows no such partition")
    gpus = limits["gpus_per_node"]  # GRES type (None: untyped) -> the most any node of the partition has
    if spec.gpu_type is not None:
        if spec.gpu_type not in gpus:
            offered = ", ".join(sorted(t for t in gpus if t)) or "no typed GPUs"
            raise SpecError(f"gpu_type {spec.gpu_type!r}: partition {limits['name']} offers {offered}")
        most = gpus[spec.gpu_type]
    else:
        most = max(gpus.values(), default=0)
    if spec.gpus_per_node > most:
        kind = f"{spec.gpu_type} " if spec.gpu_type else ""
        raise SpecError(f"gpus_per_node {spec.gpus_per_node}: partition {limits['name']} offers at most "
                        f"{most} {kind}GPUs per node")
    if limits["max_time_s"] is not None and spec.time_limit_s() > limits["max_time_s"]:
        raise SpecError(f"time {spec.time}: over partition {limits['name']}'s limit of "
                        f"{limits['max_time_s'] // 60} minutes")


def load_spec(path: str | Path, overrides: list[str] = ()) -> LaunchSpec:
    spec = load_validated(path, list(overrides), LaunchSpec, SPECS, "launch spec", SpecError)
    if spec.signal_lead_s >= spec.time_limit_s():
        raise SpecError(f"{path}: signal_lead_s {spec.signal_lead_s} is not shorter than the time limit {spec.time}")
    return spec
