"""A rank's place (trainer/distributed.py) from the scheduler's variables."""

from __future__ import annotations


def test_slurm_variables_map_to_torch_ones():
    from vitforge.core import first_host
    from vitforge.trainer.distributed import detect_env

    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node5,node6") == "node5"
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "dgx[003-004]",
           "SLURM_JOB_ID": "123456", "SLURM_TASKS_PER_NODE": "8(x2)"}
    result = detect_env(env)
    assert (result.rank, result.world_size, result.local_rank, result.master_addr) == (5, 16, 1, "dgx003")
    assert result.local_world_size == 8 and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "16" and env["MASTER_ADDR"] == "dgx003"
    assert env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
                "SLURM_PROCID": "7", "SLURM_NTASKS": "8", "LOCAL_WORLD_SIZE": "2"}
    assert detect_env(torchrun).rank == 1  # a launcher's own variables win over SLURM's
    assert detect_env(torchrun).local_world_size == 2
