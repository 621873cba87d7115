"""Naming the node a failed collective lost: gloo's "Timed out waiting Nms for recv operation"
names no peer, and a job that requeues should say which host it lost."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from vitforge.core import SchedulerEnv, atomic_write

log = logging.getLogger("vitforge.distributed")


def connect_to_rendezvous(env: SchedulerEnv, timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous store (rank 0's TCPStore) whose operations give up after
    `timeout_s`; raises TimeoutError when the connection itself takes over twice that. It is made
    on another thread and waited for a bounded time: the kernel of a frozen rank 0's host (SIGSTOP,
    a stuck process) still accepts the connection, and TCPStore's constructor then waits for its
    first answer with no timeout at all."""
    outcome: list = []

    def connect() -> None:
        try:
            outcome.append(
                dist.TCPStore(
                    env.master_addr,
                    env.master_port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s),
                )
            )
        except Exception as e:  # raised below, on the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=connect, name="vitforge-rendezvous-client", daemon=True)
    thread.start()
    thread.join(2 * timeout_s)
    if not outcome:
        raise TimeoutError(
            f"rank 0's rendezvous store {env.master_addr}:{env.master_port} did not answer within {2 * timeout_s:.0f} s"
        )
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


class PeerWatch:
    """Which nodes are alive. Each node's first rank keeps one connection to the rendezvous store
    (rank 0's TCPStore) and a thread that adds 1 to its node's counter every `interval` seconds (a
    fraction of the collective timeout); it registers its host name once.

    When a collective fails, only each node's first rank asks the store: two reads of every node's
    counter in one request each (multi_get), an interval apart, and a host name per stopped node.
    It leaves its verdict in a node-local file that the node's other ranks read, so rank 0's store
    serves one reader per node (64 at mission scale), not one per rank (512), and one request per
    read, not one per node.

    The verdict: the nodes whose counter stopped, each "node N (host H)"; [] when every other node
    is alive or left on purpose (`close` adds LEFT to its counter, on its own error or at the end:
    the collective then failed because of that error, which stays one); None when it cannot tell:
    rank 0's store did not answer in time, which a slow store and a host cut off look alike in
    (naming nobody, never the wrong node). A store whose port refuses connections has lost its
    process: rank 0's node is named.

    Per rank: nothing on most ranks; on a node's first rank one connection, one thread and one store
    write per interval. Reporting: O(nodes) integers, a file of a few hundred bytes per node."""

    PREFIX = "vitforge/peers/"
    LEFT = 1 << 40  # added to a node's counter when it leaves on purpose: never reached by beats

    def __init__(self, env: SchedulerEnv, timeout_s: float):
        self.env = env
        self.node = env.rank // env.local_world_size
        self.nodes = -(-env.world_size // env.local_world_size)
        self.interval = min(5.0, timeout_s / 8)
        self.first = env.rank % env.local_world_size == 0
        self.verdict_path = os.path.join(
            tempfile.gettempdir(),
            f"vitforge-peers-{env.master_addr}-{env.master_port}-restart{env.restart_count}-node{self.node}.json",
        )
        self._stop = threading.Event()
        self._store = None
        if self.first:
            _remove(self.verdict_path)  # an earlier job's on this node, with the same port
            self._store = self._connect()
            if env.rank == 0:  # every counter exists before anyone reads them: multi_get waits for a missing key
                for n in range(self.nodes):
                    self._store.add(self.beat_key(n), 0)
        box = [socket.gethostname()]
        dist.broadcast_object_list(box, src=0)  # rank 0's host: named even when its store is gone
        self.master_host = box[0]
        if self.first:
            self._store.set(self.host_key(self.node), socket.gethostname())
            self._store.add(self.beat_key(self.node), 1)
            threading.Thread(target=self._beat, name="vitforge-peer-watch", daemon=True).start()

    @classmethod
    def host_key(cls, node: int) -> str:
        """The store key under which node `node`'s first rank registers its host name."""
        return f"{cls.PREFIX}host/{node}"

    @classmethod
    def beat_key(cls, node: int) -> str:
        return f"{cls.PREFIX}beat/{node}"

    def _connect(self) -> dist.TCPStore:
        return connect_to_rendezvous(self.env, max(2 * self.interval, 2.0))

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._store.add(self.beat_key(self.node), 1)
            except Exception as e:  # rank 0 unreachable: a failed collective will say so
                log.debug("peer watch: %s", e)

    def _counters(self, store: dist.TCPStore) -> list[int]:
        return [int(v) for v in store.multi_get([self.beat_key(n) for n in range(self.nodes)])]

    def lost(self) -> list[str] | None:
        """The verdict (see the class): on a node's first rank after about two beat intervals, on
        its other ranks once that rank wrote it (None if it does not within the time it takes)."""
        if not self.first:
            return self._read_verdict(time.monotonic() + 2 * self.interval + 0.5 + 4 * max(2 * self.interval, 2.0) + 5)
        verdict = self._judge()
        atomic_write(self.verdict_path, json.dumps(verdict).encode())
        return verdict

    def _judge(self) -> list[str] | None:
        try:
            store = self._connect()
            before = self._counters(store)
            time.sleep(2 * self.interval + 0.5)
            after = self._counters(store)
        except Exception as e:  # the store lives in rank 0
            if self.node != 0 and _refused(self.env.master_addr, self.env.master_port):
                return [
                    f"node 0 (host {self.master_host}, {self.env.master_addr}:{self.env.master_port}, which "
                    "holds rank 0 and the rendezvous store)"
                ]
            log.warning(
                "rank 0's rendezvous store %s:%s did not answer in time (%s): cannot tell which node was lost",
                self.env.master_addr,
                self.env.master_port,
                e,
            )
            return None
        stopped = [n for n in range(self.nodes) if n != self.node and before[n] == after[n] and after[n] < self.LEFT]
        return [f"node {n} (host {self._host(store, n)})" for n in stopped]

    def _host(self, store: dist.TCPStore, node: int) -> str:
        try:
            return store.get(self.host_key(node)).decode() if store.check([self.host_key(node)]) else "unregistered"
        except Exception:  # a name is a courtesy: the node stays named by its number
            return "unknown"

    def _read_verdict(self, deadline: float) -> list[str] | None:
        while time.monotonic() < deadline:
            try:
                with open(self.verdict_path) as f:
                    return json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.2)
        return None

    def close(self) -> None:
        """This rank leaves: its node's first rank marks the node as gone on purpose."""
        self._stop.set()
        if self._store is not None:
            try:
                self._store.add(self.beat_key(self.node), self.LEFT)
            except Exception as e:  # the store is gone too: nobody is left to ask
                log.debug("peer watch: %s", e)


def _refused(host: str, port: int) -> bool:
    """Whether the store's port refuses a connection: its host answers, its process is gone."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except OSError as e:
        return e.errno == errno.ECONNREFUSED


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
