"""Where this process sits in the job (read by vitforge.core's scheduler table: torchrun / deepspeed
launcher variables, or SLURM's mapped to them); and the few collectives the trainer builds on.

The rule for collectives: a tensor handed to dist.all_reduce / broadcast / all_gather /
reduce_scatter lives on the engine's device (the one `init_distributed` returns): NCCL takes only
CUDA tensors, gloo CPU ones, so a tensor made without `device=` fails the first GPU run. Object
collectives (broadcast_object_list, all_gather_object: pickled on the host, whole, on every rank)
carry only small control data: decisions, errors, names, shapes. Never weights: a model goes
tensor by tensor with `broadcast_state`, so a rank's host peak is one tensor beyond what it holds.

Across hosts: a wrong GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is a config error before the
rendezvous (`check_socket_interfaces`), every collective and the rendezvous give up after
train.collective_timeout_s, and `PeerWatch` names the node a failed collective lost.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable, TypeVar

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
    env.update(RANK=str(result.rank), WORLD_SIZE=str(result.world_size), LOCAL_RANK=str(result.local_rank),
               LOCAL_WORLD_SIZE=str(result.local_world_size), MASTER_ADDR=result.master_addr,
               MASTER_PORT=str(result.master_port))
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
            raise ConfigError(f"{var}={value}: host {socket.gethostname()} has no interface "
                              f"{' or '.join(missing) if exact else 'starting with ' + ' or '.join(missing)} "
                              f"(it has {', '.join(have)}); name one every node has (a launch spec's "
                              "network_interface sets both variables)")


def init_distributed(env: SchedulerEnv, timeout_s: float = 600.0) -> torch.device:
    """NCCL on GPUs (one per local rank), gloo on CPU. The rendezvous and every collective give up
    after `timeout_s` (gloo raises; NCCL's watchdog may abort the process instead)."""
    import deepspeed

    check_socket_interfaces()
    timeout = timedelta(seconds=timeout_s)
    # DeepSpeed makes its data-parallel groups (ZeRO's all-gathers) with new_group(ranks), which takes
    # torch's default timeout (30 minutes), not the world group's: that default (a public name of
    # torch.distributed.distributed_c10d, read when a group is made) becomes ours in this process.
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        deepspeed.init_distributed(dist_backend="nccl", timeout=timeout)
    else:
        device = torch.device("cpu")
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    return device


def connect_to_rendezvous(env: SchedulerEnv, timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous store (rank 0's TCPStore) whose operations give up after
    `timeout_s`; raises TimeoutError when the connection itself takes over twice that. It is made
    on another thread and waited for a bounded time: the kernel of a frozen rank 0's host (SIGSTOP,
    a stuck process) still accepts the connection, and TCPStore's constructor then waits for its
    first answer with no timeout at all."""
    outcome: list = []

    def connect() -> None:
        try:
            outcome.append(dist.TCPStore(env.master_addr, env.master_port, is_master=False, wait_for_workers=False,
                                         timeout=timedelta(seconds=timeout_s)))
        except Exception as e:  # raised below, on the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=connect, name="vitforge-rendezvous-client", daemon=True)
    thread.start()
    thread.join(2 * timeout_s)
    if not outcome:
        raise TimeoutError(f"rank 0's rendezvous store {env.master_addr}:{env.master_port} did not answer within "
                           f"{2 * timeout_s:.0f} s")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


class PeerWatch:
    """Which nodes are alive, to name the one a failed collective lost (gloo's "Timed out waiting
    Nms for recv operation" names no peer). Each node's first rank keeps one connection to the
    rendezvous store (rank 0's TCPStore) and a thread that adds 1 to its node's counter every
    `interval` seconds (a fraction of the collective timeout); it registers its host name once.
    Per rank: nothing on other ranks; on a node's first rank one connection, one thread and one
    store write per interval (rank 0's store serves one per node: 64 at mission scale). Only when
    reporting: a connection of its own and O(nodes) reads, twice, an interval apart.

    A node whose counter stopped is lost unless its first rank left on purpose (`close`, on its
    own error or at the end): then the collective failed because of that error, which stays one.
    When the store cannot be reached, rank 0's node (which holds it) is the lost one."""

    PREFIX = "vitforge/peers/"

    def __init__(self, env: SchedulerEnv, timeout_s: float):
        self.env = env
        self.node = env.rank // env.local_world_size
        self.nodes = -(-env.world_size // env.local_world_size)
        self.interval = min(5.0, timeout_s / 8)
        box = [socket.gethostname()]
        dist.broadcast_object_list(box, src=0)  # rank 0's host: named even when its store is gone
        self.master_host = box[0]
        self._stop = threading.Event()
        self._store = None
        if env.rank % env.local_world_size == 0:
            self._store = self._connect()
            self._store.set(self.host_key(self.node), socket.gethostname())
            self._store.add(f"{self.PREFIX}beat/{self.node}", 1)
            threading.Thread(target=self._beat, name="vitforge-peer-watch", daemon=True).start()

    @classmethod
    def host_key(cls, node: int) -> str:
        """The store key under which node `node`'s first rank registers its host name."""
        return f"{cls.PREFIX}host/{node}"

    def _connect(self) -> dist.TCPStore:
        return connect_to_rendezvous(self.env, max(2 * self.interval, 2.0))

    def _beat(self) -> None:
        key = f"{self.PREFIX}beat/{self.node}"
        while not self._stop.wait(self.interval):
            try:
                self._store.add(key, 1)
            except Exception as e:  # rank 0 unreachable: a failed collective will say so
                log.debug("peer watch: %s", e)

    def _counters(self, store: dist.TCPStore) -> list[int]:
        return [store.add(f"{self.PREFIX}beat/{n}", 0) for n in range(self.nodes)]

    def lost(self) -> list[str]:
        """The lost nodes, each as "node N (host H)"; [] when every other node is alive or left on
        purpose. Takes about two beat intervals."""
        try:
            store = self._connect()
            before = self._counters(store)
            time.sleep(2 * self.interval + 0.5)
            after = self._counters(store)
            stopped = [n for n in range(self.nodes) if n != self.node and before[n] == after[n]
                       and not store.check([f"{self.PREFIX}left/{n}"])]
            hosts = {n: store.get(self.host_key(n)).decode()
                     if store.check([self.host_key(n)]) else "unregistered" for n in stopped}
            return [f"node {n} (host {hosts[n]})" for n in stopped]
        except Exception as e:  # the store lives in rank 0: its node is the one gone
            log.debug("peer watch: store unreachable: %s", e)
            if self.node == 0:
                return []
            return [f"node 0 (host {self.master_host}, {self.env.master_addr}:{self.env.master_port}, which holds "
                    "rank 0 and the rendezvous store)"]

    def close(self) -> None:
        """This rank leaves: its node's first rank marks the node as gone on purpose."""
        self._stop.set()
        if self._store is not None:
            try:
                self._store.set(f"{self.PREFIX}left/{self.node}", "1")
            except Exception as e:  # the store is gone too: nobody is left to ask
                log.debug("peer watch: %s", e)


def together(error: E) -> E:
    """Mark `error` as raised by every rank at the same point (what `agree` or `all_ok` shares, a
    flag agreed at a step): the ranks can then leave as on success, with a barrier (`shutdown`)."""
    error.vitforge_raised_together = True
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
            raise together(value)
    return [value for _, value in results]
