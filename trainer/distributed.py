"""Where this process sits in the job (read by vitforge.core's scheduler table: torchrun / deepspeed
launcher variables, or SLURM's mapped to them); and the few collectives the trainer builds on.

The rule for collectives: a tensor handed to dist.all_reduce / broadcast / all_gather /
reduce_scatter lives on the engine's device (the one `init_distributed` returns): NCCL takes only
CUDA tensors, gloo CPU ones, so a tensor made without `device=` fails the first GPU run. Object
collectives (broadcast_object_list, all_gather_object: pickled on the host, whole, on every rank)
carry only small control data: decisions, errors, names, shapes. Never weights: a model goes
tensor by tensor with `broadcast_state`, so a rank's host peak is one tensor beyond what it holds.

Across hosts: a wrong GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is a config error before the
rendezvous (`check_socket_interfaces`), the rendezvous gives up after train.rendezvous_timeout_s and
every collective after train.collective_timeout_s, and `PeerWatch` (peers.py) names the node a
failed collective lost.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from vitforge.core import SchedulerEnv, free_port, scheduler_env

from .config import ConfigError

log = logging.getLogger("vitforge.distributed")

T = TypeVar("T")
S = TypeVar("S")
E = TypeVar("E", bound=BaseException)


def detect_env(environ: dict | None = None) -> SchedulerEnv:
    """Where this process sits (the scheduler table in vitforge.core), with a free port when no
    launcher named one. Sets RANK etc. for torch and DeepSpeed."""
    env = os.environ if environ is None else environ
    result = scheduler_env(env)
    if not result.master_port:
        result = replace(result, master_port=free_port())
    env.update(
        RANK=str(result.rank),
        WORLD_SIZE=str(result.world_size),
        LOCAL_RANK=str(result.local_rank),
        LOCAL_WORLD_SIZE=str(result.local_world_size),
        MASTER_ADDR=result.master_addr,
        MASTER_PORT=str(result.master_port),
    )
    return result


def check_socket_interfaces(environ: dict | None = None) -> None:
    """The interfaces GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name must exist on this host: a
    wrong name is a config error here, on the host that lacks it, not a rendezvous that never
    completes. Both may be comma-separated lists; gloo takes exact names, NCCL prefixes ("=" before
    the list: exact names), and NCCL's exclusion lists ("^...") exclude rather than name."""
    env = os.environ if environ is None else environ
    have = sorted(name for _, name in socket.if_nameindex())
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var, "")
        if not value or value.startswith("^"):
            continue
        exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        names = [n for n in value.removeprefix("=").split(",") if n]
        missing = [n for n in names if not (n in have if exact else any(i.startswith(n) for i in have))]
        if missing:
            raise ConfigError(
                f"{var}={value}: host {socket.gethostname()} has no interface "
                f"{' or '.join(missing) if exact else 'starting with ' + ' or '.join(missing)} "
                f"(it has {', '.join(have)}); name one every node has (a launch spec's "
                "network_interface sets both variables)"
            )


def init_distributed(env: SchedulerEnv, timeout_s: float = 600.0, rendezvous_timeout_s: float = 900.0) -> torch.device:
    """NCCL on GPUs (one per local rank), gloo on CPU. The rendezvous waits `rendezvous_timeout_s`
    for every rank (a node's slow start-up is no lost peer); then every collective gives up after
    `timeout_s` (gloo raises; NCCL's watchdog may abort the process instead)."""
    import deepspeed

    check_socket_interfaces()
    timeout = timedelta(seconds=timeout_s)
    rendezvous = timedelta(seconds=rendezvous_timeout_s)
    # DeepSpeed makes its data-parallel groups (ZeRO's all-gathers) with new_group(ranks), which takes
    # torch's default timeout (30 minutes), not the world group's: that default (a public name of
    # torch.distributed.distributed_c10d, read when a group is made) becomes ours in this process.
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        deepspeed.init_distributed(dist_backend="nccl", timeout=rendezvous)
    else:
        device = torch.device("cpu")
        deepspeed.init_distributed(dist_backend="gloo", timeout=rendezvous)
    # torch >= 2.6 names it set_timeout; from 2.3 it was _set_pg_timeout (pyproject allows 2.4)
    set_timeout = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout
    set_timeout(timeout)
    return device


def together(error: E) -> E:
    """Mark `error` as raised by every rank at the same point (what `agree` or `all_ok` shares, a
    flag agreed at a step): the ranks can then leave as on success, with a barrier (`shutdown`)."""
    error.vitforge_raised_together = True  # type: ignore[attr-defined]  # (our own flag, on any exception)
    return error


def raised_together(error: BaseException) -> bool:
    return getattr(error, "vitforge_raised_together", False)


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
        raise together(value)
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


def broadcast_state(
    state: dict[str, torch.Tensor] | None,
    device: torch.device,
    receive: Callable[[str, torch.Tensor], None],
    src: int = 0,
) -> None:
    """Rank `src`'s state dict to every rank, one tensor at a time on `device` (the engine's):
    `receive(name, tensor)` runs on every rank, `src` too, for each entry in `state`'s order; the
    tensor is only valid during the call (copy it where it belongs). Other ranks pass None.
    Per rank: the names, shapes and dtypes (one object broadcast, a few bytes per tensor) and one
    tensor on `device` at a time, whatever the model's size."""
    mine = dist.get_rank() == src
    layout = [[(name, tuple(t.shape), t.dtype) for name, t in state.items()] if mine else None]
    dist.broadcast_object_list(layout, src=src)
    for name, shape, dtype in layout[0]:
        tensor = (
            state[name].detach().to(device).contiguous() if mine else torch.empty(shape, dtype=dtype, device=device)
        )
        dist.broadcast(tensor, src=src)
        receive(name, tensor)


def all_ok(fn: Callable[[], T]) -> list[T]:
    """Every rank runs `fn`; if any raised, every rank raises the lowest failing rank's exception.
    Returns every rank's result."""
    mine: tuple[str, object]
    try:
        mine = ("ok", fn())
    except Exception as e:  # shared with every rank, raised there
        mine = ("error", e)
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    for kind, value in results:
        if kind == "error":
            raise together(value)
    return [value for _, value in results]
