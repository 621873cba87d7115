"""Launch specs: one validated schema for a multi-node SLURM training job, YAML files in
cluster/specs/ plus `--set a.b=c` overrides, like the trainer's config."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from vitforge.core import UsageError
from vitforge.core.settings import Strict, load_validated

SPECS = Path(__file__).resolve().parent / "specs"
# Names that carry credentials: never written into a script; jobs get them from the environment
# they are submitted from (sbatch exports it) or from a credentials file the cluster has.
SECRET_NAME = re.compile(
    r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|ACCOUNT_KEY|STORAGE_KEY|CONNECTION_STRING"
    r"|(^|_)SAS(_|$)|PRIVATE|SESSION",
    re.IGNORECASE,
)


def _whole(pattern: str, expected: str) -> AfterValidator:
    """Validates a str that must match `pattern` as a whole (no trailing newline slips past a `$`).
    Every spec value reaches the sbatch script: this is what it may contain there; render.py quotes it."""
    regex = re.compile(pattern)

    def check(value: str) -> str:
        if not regex.fullmatch(value):
            raise ValueError(f"{value!r}: {expected}")
        return value

    return AfterValidator(check)


# Written bare into #SBATCH lines (and file names): no shell, quoting or comment syntax at all.
SlurmName = Annotated[str, _whole(r"[A-Za-z0-9_.-]+", "letters, digits, '_', '.', '-' only")]
# SLURM's feature expressions: AND &, OR |, matching OR [...], counts *N, grouping (), NOT !.
Constraint = Annotated[
    str,
    _whole(
        r"[A-Za-z0-9_.:&|,\[\]*()!-]+",
        "node features (letters, digits, '_', '.', '-', ':') joined by SLURM's & | , [ ] * ( ) ! only",
    ),
]
SlurmTime = Annotated[
    str, _whole(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", "expected a SLURM time such as 04:00:00 or 2-00:00:00")
]
SlurmSize = Annotated[str, _whole(r"\d+[KMGT]?", "expected a SLURM size such as 900G, 64000 (MB) or 2T")]
# Linux interface names: at most 15 characters (IFNAMSIZ), no '/', ':' or whitespace.
InterfaceName = Annotated[
    str,
    _whole(r"[A-Za-z0-9_.-]{1,15}", "an interface name such as eth0 or ib0: at most 15 letters, digits, '_', '.', '-'"),
]
EnvName = Annotated[
    str, _whole(r"[A-Za-z_][A-Za-z0-9_]*", "a variable name: letters, digits and '_', not starting with a digit")
]
# Paths and free values: anything on one line (a line break would end a #SBATCH block or a shell
# word's line, NUL cannot be in a script); they are shell-quoted wherever they are written.
Text = Annotated[str, _whole(r"[^\x00-\x1f\x7f]*", "one line of text: no line break, NUL or other control character")]
# pyxis splits --container-mounts at commas.
Mount = Annotated[
    str,
    _whole(
        r"[^\x00-\x1f\x7f,]+",
        "SRC:DST[:FLAGS] on one line: no ',' (mounts are joined with commas), line break, NUL or other "
        "control character",
    ),
]
# A backslash anywhere in --output makes SLURM drop it and stop expanding %x/%j (every job, one file).
LogDir = Annotated[
    str,
    _whole(
        r"[^\x00-\x1f\x7f\\]+",
        "a folder on one line: no '\\' (SLURM's file patterns), line break, NUL or other control character",
    ),
]


class SpecError(UsageError):
    kind = "spec error"


class Container(Strict):
    image: Text
    """A container image for pyxis/enroot (srun --container-image)."""
    mounts: list[Mount] = []
    """SRC:DST mounts (srun --container-mounts)."""


class TrainJob(Strict):
    config: Text
    """A trainer recipe name or YAML path, as `vitforge train` takes it."""
    overrides: list[Text] = []
    """KEY=VALUE trainer overrides (`--set`), e.g. [train.steps=1000]."""
    dataset: Text | None = None
    """Sets data.train."""
    checkpoint_dir: Text | None = None
    """Sets checkpoint.dir (s3:// for runs that survive any node)."""


class EvalJob(Strict):
    config: Text
    """A trainer recipe name or YAML path, as `vitforge eval` takes it (the model comes from the checkpoint)."""
    checkpoint: Text
    """A run (DIR/RUN: its newest complete checkpoint) or one checkpoint (DIR/RUN/step_N), local or s3://."""
    dataset: Text | None = None
    """Sets data.val, the set evaluated."""
    overrides: list[Text] = []
    """KEY=VALUE overrides (`--set`), e.g. [data.micro_batch=64]."""


class ShardArray(Strict):
    src: Text
    """What `vitforge shard` takes: class folders or a manifest, local or s3://."""
    dest: Text
    """The dataset's folder or s3:// prefix."""
    num_parts: int = Field(ge=1)
    """One array task per part; a dependent job merges them into dataset.json."""
    throttle: int | None = Field(None, ge=1)
    """At most this many parts at once (--array=...%N)."""
    args: list[Text] = []
    """More `vitforge shard` options, e.g. [--shard-bytes, 1GiB, --max-side, "512"]."""


class LaunchSpec(Strict):
    name: SlurmName
    """The job's name (letters, digits, '_', '.', '-')."""
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=0)
    tasks_per_node: int | None = Field(None, ge=1)
    """Default: one task (rank) per GPU, 1 without GPUs."""
    cpus_per_task: int = Field(8, ge=1)
    """CPU cores per rank (decode workers run on them)."""
    mem_per_node: SlurmSize | None = None
    """SLURM's --mem, e.g. "900G". Give at most one memory request; none: the partition's default."""
    mem_per_cpu: SlurmSize | None = None
    """SLURM's --mem-per-cpu, e.g. "8G": scales with cpus_per_task x tasks."""
    mem_per_gpu: SlurmSize | None = None
    """SLURM's --mem-per-gpu, e.g. "110G"."""
    gpu_type: SlurmName | None = None
    """A GRES type, e.g. "h100": requests --gpus-per-node=h100:8."""
    time: SlurmTime = "04:00:00"
    """The time limit, D-HH:MM:SS (SLURM's forms); the trainer stops itself signal_lead_s before it."""
    partition: SlurmName | None = None
    """SLURM names (partition, account, qos): letters, digits, '_', '.', '-'."""
    account: SlurmName | None = None
    qos: SlurmName | None = None
    constraint: Constraint | None = None
    """Node features, e.g. "h100" or "h100|h200" (SLURM's & | [ ] * ( ) operators)."""
    exclusive: bool = False
    """Whole nodes only."""
    container: Container | None = None
    """Run the ranks in a container (pyxis/enroot)."""
    venv: Text | None = None
    """A virtualenv to activate on every node."""
    env: dict[EnvName, Text] = {}
    """Variables exported in the script (names: letters, digits, '_'); credentials are refused (the job
    inherits them instead)."""
    nccl: Literal["none", "infiniband", "efa", "roce"] = "none"
    """The interconnect's NCCL settings."""
    network_interface: InterfaceName | None = None
    """The interface the ranks talk over, e.g. "eth0" or "ib0": exported as GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME, and the rendezvous address is its IPv4 address on the first node. None: the
    first node's name as `getent ahostsv4` resolves it (refused when that is loopback on a multi-node
    job). A name some node lacks fails the job before training."""
    train: TrainJob | None = None
    """A training job (give exactly one of train, eval and shard)."""
    eval: EvalJob | None = None
    """An evaluation of a checkpoint (`vitforge eval`) on every rank of the allocation."""
    shard: ShardArray | None = None
    """A sharding job array plus a dependent merge job."""
    max_requeues: int = Field(10, ge=0)
    """Self-requeues after a stop signal or time budget, at most."""
    max_hang_requeues: int = Field(2, ge=0)
    """Requeues after a hang (the trainer's watchdog, exit code 76), at most, in the job's life (each
    also counts toward max_requeues): a hang that comes back is a bug or a bad node, not bad luck."""
    signal_lead_s: int = Field(180, ge=10)
    """SIGUSR1 this long before the time limit (--signal=USR1@N): time to save and requeue."""
    log_dir: LogDir = "slurm-logs"
    """The job logs' folder (%x-%j.out): any path on one line without '\\'."""

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        secret = sorted(k for k in value if SECRET_NAME.search(k))
        if secret:
            raise ValueError(
                f"{', '.join(secret)}: credentials are never written into a job script; export them "
                "where you run `vitforge submit` (sbatch passes the environment on) or use the "
                "cluster's credentials file"
            )
        return value

    @model_validator(mode="after")
    def _one_job(self):
        if sum(job is not None for job in (self.train, self.eval, self.shard)) != 1:
            raise ValueError("give exactly one of train:, eval: or shard:")
        memory = [k for k in ("mem_per_node", "mem_per_cpu", "mem_per_gpu") if getattr(self, k) is not None]
        if len(memory) > 1:
            raise ValueError(f"{' and '.join(memory)}: give at most one (SLURM takes one memory request)")
        if self.mem_per_gpu and not self.gpus_per_node:
            raise ValueError("mem_per_gpu: the spec requests no GPUs (gpus_per_node is 0)")
        if self.gpu_type and not self.gpus_per_node:
            raise ValueError("gpu_type: the spec requests no GPUs (gpus_per_node is 0)")
        both = [k for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in self.env]
        if self.network_interface and both:
            raise ValueError(f"env.{both[0]} and network_interface: give one (network_interface sets both variables)")
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
        hours, minutes, seconds = [*parts, 0, 0][:3]
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
        raise SpecError(
            f"gpus_per_node {spec.gpus_per_node}: partition {limits['name']} offers at most {most} {kind}GPUs per node"
        )
    if limits["max_time_s"] is not None and spec.time_limit_s() > limits["max_time_s"]:
        raise SpecError(
            f"time {spec.time}: over partition {limits['name']}'s limit of {limits['max_time_s'] // 60} minutes"
        )


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> LaunchSpec:
    spec = load_validated(path, list(overrides), LaunchSpec, SPECS, "launch spec", SpecError)
    if spec.signal_lead_s >= spec.time_limit_s():
        raise SpecError(f"{path}: signal_lead_s {spec.signal_lead_s} is not shorter than the time limit {spec.time}")
    return spec
