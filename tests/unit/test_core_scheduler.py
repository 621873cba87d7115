"""The scheduler table (core/scheduler.py): each environment's row, its order, and bad values naming
their variable. Pure environment dicts: no processes. (That it imports no torch, which a login node
relies on, is test_architecture.py's.)"""

import pytest

from vitforge.core import SCHEDULERS, UsageError, first_host, scheduler_env

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
