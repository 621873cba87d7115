"""A private single-node SLURM on localhost (Debian's slurmctld/slurmd) from a generated config
in a folder of its own, for the tests and `vitforge demo`: the real daemons, nothing mocked.

It runs as root with no authentication (auth/none), so it is for a machine of one's own: jobs
reach it only through SLURM_CONF, which `start_local_slurm` returns; a site's SLURM is untouched.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from vitforge.core import free_port

# What every private SLURM here shares (this one and the tests' multi-host cluster): root daemons
# without authentication, no accounting, quick scheduling.
LOCAL_SLURM_SETTINGS = """SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
InactiveLimit=0
MinJobAge=300
KillWait=5
OverTimeLimit=0
DependencyParameters=kill_invalid_depend
# A requeued job may start 10 s later; schedule every 2 s, not 60, so it does (the loop tests wait less).
SchedulerParameters=sched_interval=2,bf_interval=1
"""


def _ensure_host_resolves(host: str) -> None:
    try:
        socket.gethostbyname(host)
    except socket.gaierror:
        with open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {host}\n")


def local_slurm_missing() -> str | None:
    """Why a private SLURM cannot start here, or None when it can."""
    for daemon in ("slurmctld", "slurmd", "sinfo", "sbatch"):
        if shutil.which(daemon) is None:
            return f"{daemon} is missing (`make test` installs Debian's slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "its daemons must run as root here (SlurmUser=root, auth/none)"
    return None


def start_local_slurm(folder: Path | str, first_job_id: int = 1) -> dict:
    """Start slurmctld and slurmd; return the environment ({"SLURM_CONF": ...}) that reaches them.
    `first_job_id`: where job ids start. A job's rendezvous port derives from its id, so private
    SLURMs side by side on one machine (one per test worker) number their jobs apart."""
    why = local_slurm_missing()
    if why:
        raise RuntimeError(f"cannot start a local SLURM: {why}")
    folder = Path(folder)
    host = socket.gethostname().split(".")[0]
    _ensure_host_resolves(host)
    memory_mib = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 - 1024
    (folder / "log").mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(f"""ClusterName=ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
FirstJobId={first_job_id}
{LOCAL_SLURM_SETTINGS}GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mib} Gres=gpu:testgpu:2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes={host} MaxTime=10 State=UP
""")
    # Two GPUs of a made-up type with no device files (a fake, named as such): jobs here request
    # none; they let submit's partition checks read typed GRES from a real sinfo.
    (folder / "gres.conf").write_text("Name=gpu Type=testgpu File=/dev/null\nName=gpu Type=testgpu File=/dev/zero\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True)
    subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True)
    deadline = time.monotonic() + 60
    while True:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
        if state == "idle":
            return {"SLURM_CONF": str(conf)}
        if time.monotonic() > deadline:
            log = (folder / "log" / "slurmctld.log").read_text()[-2000:]
            raise RuntimeError(f"SLURM did not come up (sinfo says {state!r}): {log}")
        time.sleep(0.3)


def stop_local_slurm(env: dict) -> None:
    subprocess.run(["scontrol", "shutdown"], env={**os.environ, **env}, capture_output=True)
