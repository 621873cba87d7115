"""Where this process sits in the job: torchrun / deepspeed launcher variables, or SLURM's mapped to
them; and the few collectives the trainer builds on.

The rule for collectives: a tensor handed to dist.all_reduce / broadcast / all_gather /
reduce_scatter lives on the engine's device (the one `init_distributed` returns): NCCL takes only
CUDA tensors, gloo CPU ones, so a tensor made without `device=` fails the first GPU run. Object
collectives (broadcast_object_list, all_gather_object: pickled on the host, whole, on every rank)
carry only small control data: decisions, errors, names, shapes. Never weights: a model goes
tensor by tensor with `broadcast_state`, so a rank's host peak is one tensor beyond what it holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from vitforge.core import free_port

T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    # Ranks per node; the ranks of node n are n*L .. n*L+L-1 (torchrun's numbering, and srun's block
    # distribution, the default). 1 when the launcher does not say.
    local_world_size: int = 1


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as 'gpu[07-09,12],cpu1' (what `scontrol show hostnames`
    prints first)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_env(environ: dict | None = None) -> DistEnv:
    """Read the launcher's variables; under srun, map SLURM's. Sets RANK etc. for torch and DeepSpeed."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        result = DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                         int(env.get("LOCAL_WORLD_SIZE", 1)))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0"))
        result = DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
                         int(env.get("MASTER_PORT") or 20000 + job % 20000),
                         int(re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
                                      or "1").group()))
    else:
        result = DistEnv(0, 1, 0, "127.0.0.1", free_port())
    env.update(RANK=str(result.rank), WORLD_SIZE=str(result.world_size), LOCAL_RANK=str(result.local_rank),
               LOCAL_WORLD_SIZE=str(result.local_world_size), MASTER_ADDR=result.master_addr,
               MASTER_PORT=str(result.master_port))
    return result


def init_distributed(env: DistEnv) -> torch.device:
    """NCCL on GPUs (one per local rank), gloo on CPU."""
    import deepspeed

    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        deepspeed.init_distributed(dist_backend="nccl")
    else:
        device = torch.device("cpu")
        deepspeed.init_distributed(dist_backend="gloo")
    return device


def shutdown(graceful: bool = True) -> None:
    """On success: barrier then destroy, so no rank exits while another still talks to it (about 1
    run in 6 aborts at exit otherwise, docs/ARCHITECTURE.md). On error: destroy at once, which breaks
    the other ranks' pending collectives so they fail too instead of hanging in a barrier."""
    if dist.is_available() and dist.is_initialized():
        try:
            if graceful:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def agree(fn: Callable[[], T]) -> T:
    """Rank 0 runs `fn`; every rank returns its result or raises its exception. Decisions that
    read the store (which checkpoint, who owns the run) are made once and can never differ
    between ranks, and a failure ends every rank the same way instead of hanging the others."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # handed to every rank, raised there
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def agree_keeping(fn: Callable[[], T], summary: Callable[[T], S]) -> tuple[T | None, S]:
    """`agree` for a result too big to ship (weights): rank 0 runs `fn` and keeps its result (None
    on the other ranks); every rank gets `summary(result)`, small control data, or raises rank 0's
    exception."""
    kept: list = [None]

    def run() -> S:
        kept[0] = fn()
        return summary(kept[0])

    shared = agree(run)
    return kept[0], shared


def broadcast_state(state: dict[str, torch.Tensor] | None, device: torch.device,
                    receive: Callable[[str, torch.Tensor], None], src: int = 0) -> None:
    """Rank `src`'s state dict to every rank, one tensor at a time on `device` (the engine's):
    `receive(name, tensor)` runs on every rank, `src` too, for each entry in `state`'s order; the
    tensor is only valid during the call (copy it where it belongs). Other ranks pass None.
    Per rank: the names, shapes and dtypes (one object broadcast, a few bytes per tensor) and one
    tensor on `device` at a time, whatever the model's size."""
    mine = dist.get_rank() == src
    layout = [[(name, tuple(t.shape), t.dtype) for name, t in state.items()] if mine else None]
    dist.broadcast_object_list(layout, src=src)
    for name, shape, dtype in layout[0]:
        tensor = state[name].detach().to(device).contiguous() if mine else \
            torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src)
        receive(name, tensor)


def all_ok(fn: Callable[[], T]) -> list[T]:
    """Every rank runs `fn`; if any raised, every rank raises the lowest failing rank's exception.
    Returns every rank's result."""
    try:
        mine = ("ok", fn())
    except Exception as e:  # shared with every rank, raised there
        mine = ("error", e)
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    for kind, value in results:
        if kind == "error":
            raise value
    return [value for _, value in results]
