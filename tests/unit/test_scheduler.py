"""The scheduler table (vitforge.core.scheduler): each environment's row, its order, bad values naming
their variable, and the light imports a login node relies on. Pure environment dicts: no processes."""

import socket
import subprocess
import sys

import pytest

from vitforge.core import SCHEDULERS, UsageError, first_host, free_port, scheduler_env
from vitforge.core.scheduler import SLURM_PORT_BASE

SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "dgx[003-004]",
        "SLURM_JOB_ID": "123456", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_RESTART_COUNT": "2"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400"}


def test_rows_in_detect_order():
    assert [row.name for row in SCHEDULERS] == ["torchrun", "slurm", "single"]


def test_torchrun():
    env = scheduler_env(TORCHRUN)
    assert (env.scheduler, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.job, env.restart_count, env.array_index) == \
        ("10.0.0.1", 29400, None, 0, None)
    bare = scheduler_env({"RANK": "0", "WORLD_SIZE": "1"})  # the deepspeed launcher's minimum: defaults
    assert (bare.local_rank, bare.local_world_size, bare.master_addr, bare.master_port) == (0, 1, "127.0.0.1", 29500)


def test_srun():
    env = scheduler_env(SRUN)
    assert (env.scheduler, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 16, 1, 8)
    assert (env.master_addr, env.master_port) == ("dgx003", 20000 + 123456 % 20000)
    assert (env.job, env.restart_count, env.array_index) == ("slurm:123456", 2, None)
    assert scheduler_env({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}).master_port == 4000
    assert scheduler_env({**SRUN, "SLURM_NTASKS_PER_NODE": "4"}).local_world_size == 4


def test_torchrun_inside_a_slurm_job():
    """A launcher's own numbering wins over SLURM's; the job around it is still SLURM's (its lease owner)."""
    env = scheduler_env({**SRUN, **TORCHRUN})
    assert (env.scheduler, env.rank, env.world_size, env.job, env.restart_count) == \
        ("torchrun", 3, 4, "slurm:123456", 2)


def test_single_process_and_array_task():
    env = scheduler_env({})
    assert (env.scheduler, env.rank, env.world_size, env.local_rank, env.master_port, env.job) == \
        ("single", 0, 1, 0, 0, None)
    # An sbatch array task without srun: one process, its job named as scancel takes it.
    task = scheduler_env({"SLURM_JOB_ID": "900", "SLURM_ARRAY_JOB_ID": "890", "SLURM_ARRAY_TASK_ID": "7",
                          "SLURM_ARRAY_TASK_MIN": "4"})
    assert (task.scheduler, task.job, task.array_index) == ("single", "slurm:890_7", 3)
    assert scheduler_env({"SLURM_ARRAY_TASK_ID": "5"}).array_index == 5


@pytest.mark.parametrize("env, message", [
    ({**TORCHRUN, "RANK": "one"}, "RANK='one' is not a whole number"),
    ({**TORCHRUN, "RANK": "4"}, "RANK=4 is not a rank of WORLD_SIZE=4"),
    ({**TORCHRUN, "MASTER_PORT": "-1"}, "MASTER_PORT='-1' is not a whole number"),
    ({**SRUN, "SLURM_NTASKS": "0"}, "SLURM_PROCID=5 is not a rank of SLURM_NTASKS=0"),
    ({**SRUN, "SLURM_LOCALID": ""}, None),  # empty optional value: its default
    ({**SRUN, "SLURM_TASKS_PER_NODE": "(x2)"}, "SLURM_TASKS_PER_NODE='(x2)' does not start with a number of tasks"),
    ({**SRUN, "SLURM_JOB_NODELIST": ","}, "cannot read SLURM node list ','"),
    ({**SRUN, "SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT='x' is not a whole number"),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "a"}, "SLURM_ARRAY_TASK_MIN='a' is not a whole number"),
])
def test_bad_values_name_their_variable(env, message):
    if message is None:
        assert scheduler_env(env).local_rank == 0
        return
    with pytest.raises(UsageError) as error:
        scheduler_env(env)
    assert str(error.value) == message


def test_first_host():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node5,node6") == "node5"


@pytest.mark.parametrize("module", ["vitforge.cluster.render", "vitforge.cluster.launcher", "vitforge.core.scheduler"])
def test_light_modules_import_no_torch(module):
    """A login node renders and submits scripts, and a sharding task reads its array index, without torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_process_rank_never_fails_logging(monkeypatch):
    """A bad variable is reported by what reads the place (the trainer, the lease); the logs still work."""
    from vitforge.core import process_rank

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert process_rank() == 3
    monkeypatch.setenv("RANK", "three")
    assert process_rank() == 0


def test_launcher_registry_and_the_slurm_launcher():
    from vitforge.cluster import LAUNCHERS, SlurmLauncher, get_launcher, load_spec, render
    from vitforge.cluster.render import render_merge, render_shard_array

    assert sorted(LAUNCHERS) == ["slurm"] and isinstance(get_launcher(), SlurmLauncher)
    with pytest.raises(UsageError, match="unknown launcher 'k8s'; known: slurm"):
        get_launcher("k8s")
    slurm = get_launcher("slurm")
    assert slurm.parse_job("1234_7") == "1234_7" and slurm.parse_job("1234+1") == "1234+1"
    with pytest.raises(ValueError, match=r"'12a' is not a SLURM job id \(e.g. 1234 or 1234_7\)"):
        slurm.parse_job("12a")
    train = load_spec("tiny_cpu", [])
    assert [tuple(s) for s in slurm.scripts(train)] == \
        [(f"{train.name}.sbatch", render(train), "job", f"{train.name}-{{job}}.out")]
    shard = load_spec("imagenet21k_shard", [])
    array, merge = slurm.scripts(shard, [1, 3])
    assert (array.text, array.kind, merge.text, merge.kind) == \
        (render_shard_array(shard, [1, 3]), "job array", render_merge(shard), "merge job")


def test_a_free_port_is_below_the_ephemeral_range_and_the_slurm_jobs_ports():
    # A server's port must be neither one an outgoing connection may take (the ephemeral range) nor
    # one a SLURM job on this host binds from its id without asking (SLURM_PORT_BASE up).
    ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(200)}
    assert all(10000 <= port < min(ephemeral, SLURM_PORT_BASE) for port in ports), sorted(ports)
    assert len(ports) > 150  # at random, not one port handed to every test worker
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free when handed out
