"""`vitforge plan`'s figures (cluster/planner_formulas.py, planner.py), each formula against a hand
calculation with small round numbers: throughput, checkpoint size and interval, communication per
ZeRO stage, restart time and host memory; then the figures together, the report, and the ViT
paper's own setups end to end."""

from __future__ import annotations

import math

import pytest

from vitforge.cluster import PlanInput, plan, report
from vitforge.cluster.planner_formulas import (ModelFacts, accumulation, checkpoint_bytes_per_rank, comm_bandwidth,
                                            comm_bytes_per_rank, exposed_seconds, host_bytes_per_rank,
                                            intervals_within, lost_fraction, node_read_bandwidth, restart_seconds,
                                            restore_bytes_per_node, ring_collectives, ring_latency, throughput,
                                            write_seconds, young_daly_interval)
from vitforge.core import UsageError


def test_throughput_is_mfu_times_peak_over_flops():
    assert throughput(1e12, 989e12, 0.5) == pytest.approx(494.5)


def test_checkpoint_bytes_per_zero_stage():
    # 1e9 parameters, 8 ranks: weights 2 GB (bf16), optimizer 12 GB (fp32 master + Adam m, v).
    assert checkpoint_bytes_per_rank(10**9, 0, 8) == (14e9, 14e9)
    assert checkpoint_bytes_per_rank(10**9, 1, 8) == (2e9 + 1.5e9, 14e9)
    assert checkpoint_bytes_per_rank(10**9, 2, 8) == (3.5e9, 14e9)
    assert checkpoint_bytes_per_rank(10**9, 3, 8) == (1.75e9, 14e9)
    assert write_seconds(3.5e9, 14e9, 1e9, 10e9) == 3.5  # the busiest rank is slower than the store
    assert write_seconds(1.75e9, 14e9, 1e9, 2e9) == 7.0  # the store is the limit


def test_young_daly_interval_and_the_target_window():
    checkpoint_s, mtbf_s = 60.0, 36_000.0
    tau = young_daly_interval(checkpoint_s, mtbf_s)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 36_000)) == pytest.approx(2078.46, abs=0.01)
    # At Young's interval both terms are equal: sqrt(2C/M) in all.
    assert lost_fraction(tau, checkpoint_s, mtbf_s) == pytest.approx(2 * 60 / 2078.46, rel=1e-4)
    low, high = intervals_within(0.1, checkpoint_s, mtbf_s)
    assert (low, high) == (pytest.approx(660.6, abs=0.1), pytest.approx(6539.4, abs=0.1))
    assert lost_fraction(low, checkpoint_s, mtbf_s) == pytest.approx(0.1)
    assert lost_fraction(high, checkpoint_s, mtbf_s) == pytest.approx(0.1)
    assert intervals_within(0.05, checkpoint_s, mtbf_s) is None  # Young's interval already loses 5.8%


def test_plan_figures_agree_with_each_other():
    inputs = PlanInput(model="vit_base_patch16_224", dataset_images=1_000_000, epochs=10, nodes=2, gpus_per_node=4,
                       device="A100", mfu=0.5, mean_image_bytes=100_000, shard_bytes=10**9,
                       read_block_bytes=8 << 20, node_mtbf_hours=1000)
    result = plan(inputs)
    per_gpu = 0.5 * 312e12 / result["flops_per_image"]
    assert result["images_per_s_per_gpu"] == pytest.approx(per_gpu)
    assert result["images_per_s"] == pytest.approx(8 * per_gpu)
    assert result["epoch_hours"] == pytest.approx(1e6 / (8 * per_gpu) / 3600)
    assert result["gpu_hours"] == pytest.approx(10 * result["epoch_hours"] * 8)
    assert result["decode_cores_per_node_cpu"] == pytest.approx(4 * per_gpu * PlanInput().cpu_decode_ms / 1000)
    assert result["shards"] == 100 and result["shard_images"] == 10_000
    # Each node's ranks read adjacent partitions: half the shards plus the one cut in two at the seam.
    assert result["egress_bytes_per_node_per_epoch"] == 51 * 10**9
    assert result["store_gets_per_s"] == pytest.approx(8 * per_gpu * 100_000 / (8 << 20))
    assert result["job_mtbf_hours"] == 500
    assert abs(result["parameters"] - 86.57e6) / 86.57e6 < 0.01


def test_vit_h14_on_jft_matches_the_papers_compute():
    """The ViT paper reports 2.5k TPUv3-core-days for ViT-H/14 on JFT-300M (14 epochs)."""
    result = plan(PlanInput(model="vit_huge_patch14_224", dataset_images=300_000_000, epochs=14, nodes=1,
                            gpus_per_node=1, device="TPUv3-core", mfu=0.3))
    core_days = result["gpu_hours"] / 24
    assert 1250 < core_days < 5000, core_days


def test_communication_bytes_per_stage():
    # 1e9 parameters in bf16 (2 GB), 8 ranks: a ring pass sends 7/8 x 2 GB = 1.75 GB per rank.
    assert [comm_bytes_per_rank(10**9, stage, 8, 1) for stage in range(4)] == [3.5e9, 3.5e9, 3.5e9, 5.25e9]
    # 4 micro-steps: ZeRO-0/1 reduce once per step, ZeRO-2 reduce-scatters every micro-step (4 + 1
    # passes), ZeRO-3 does its three passes every micro-step (12).
    assert [comm_bytes_per_rank(10**9, stage, 8, 4) for stage in range(4)] == [3.5e9, 3.5e9, 8.75e9, 21e9]
    assert comm_bytes_per_rank(10**9, 3, 1, 1) == 0
    assert accumulation(4096, 64, 8) == 8 and accumulation(4096, 64, 512) == 1 and accumulation(100, 3, 8) == 5


def test_ring_latency_collectives_bandwidth_and_overlap():
    # 1e9 parameters: 2 buckets of 5e8 for reductions, 20 prefetch buckets of 5e7 for ZeRO-3's gathers.
    assert [ring_collectives(stage, 10**9, 1) for stage in range(4)] == [4, 4, 4, 42]
    assert ring_collectives(2, 10**9, 2) == 6 and ring_collectives(3, 10**9, 2) == 84
    # 16 ranks on 2 nodes: 15 steps, 1 between the nodes.
    assert ring_latency(16, 2) == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 9.6e-6)
    assert ring_latency(8, 1) == pytest.approx(8.4e-6 + 7 * 3.4e-6) and ring_latency(1, 1) == 0
    assert comm_bandwidth(1, 450e9, 400e9) == 450e9  # one node: NVLink only
    assert comm_bandwidth(2, 450e9, 400e9) == 400e9 and comm_bandwidth(2, 450e9, 100e9) == 100e9
    assert exposed_seconds(10, 20, 0) == 10 and exposed_seconds(10, 20, 1) == 0
    assert exposed_seconds(10, 20, 0.5) == 5
    assert exposed_seconds(30, 20, 1) == 10 and exposed_seconds(30, 20, 0.5) == 15  # compute hides <= itself


def test_restart_time_and_its_share_of_the_run():
    # 1e9 parameters (14 GB of checkpoint), 8 ranks on 2 nodes of 4.
    assert restore_bytes_per_node(10**9, 0, 8, 4) == 14e9
    assert restore_bytes_per_node(10**9, 1, 8, 4) == restore_bytes_per_node(10**9, 2, 8, 4) == 2e9 + 4 * 1.5e9
    assert restore_bytes_per_node(10**9, 3, 8, 4) == 7e9
    assert node_read_bandwidth(25e9, 50e9, 4) == 12.5e9 and node_read_bandwidth(25e9, 50e9, 1) == 25e9
    assert restart_seconds(1e9, 8e9, 1e9, 60) == {"index_s": 1, "checkpoint_s": 8, "warmup_s": 60, "total_s": 69}
    # C = 60 s, M = 10 h, R = 6 min: each failure costs R on top of half an interval.
    assert lost_fraction(2000, 60, 36_000, 360) == pytest.approx(60 / 2000 + (1000 + 360) / 36_000)
    low, high = intervals_within(0.1, 60, 36_000, 360)
    share = 0.1 - 0.01
    root = math.sqrt(share ** 2 - 2 * 60 / 36_000)
    assert (low, high) == (pytest.approx(36_000 * (share - root)), pytest.approx(36_000 * (share + root)))
    assert lost_fraction(low, 60, 36_000, 360) == pytest.approx(0.1)
    assert lost_fraction(high, 60, 36_000, 360) == pytest.approx(0.1)
    assert intervals_within(0.1, 60, 36_000, 360)[1] < intervals_within(0.1, 60, 36_000)[1]
    assert intervals_within(0.02, 60, 36_000, 720) is None  # restarts alone lose the whole target


def test_host_memory_per_rank():
    facts = ModelFacts(flops_per_image=1.0, parameters=10**9, largest_tensor=10**6)
    rank = host_bytes_per_rank(3, facts, 8, 1000, 64, 1e9, offload=True)
    assert rank == {"index": 64_000, "cache": 1e9, "offload": 16e9 / 8, "staging": 14e9 / 8,
                    "eval": 4e9 / 8 + 4e6, "total": 64_000 + 1e9 + 2e9 + 1.75e9 + 0.504e9}
    plain = host_bytes_per_rank(0, facts, 8, 1000, 64, 1e9, offload=True)  # stage 0 cannot offload
    assert plain["offload"] == 0 and plain["staging"] == 14e9 and plain["eval"] == 4e9 + 4e6


def _small() -> PlanInput:
    # ViT-B/16 on 2 nodes of 4: 1,000 shards of 1 GB (10,000 images of 100 kB), 256 images a step
    # in micro-batches of 16, so 2 micro-steps.
    return PlanInput(model="vit_base_patch16_224", dataset_images=10_000_000, epochs=2, nodes=2, gpus_per_node=4,
                     device="A100", mfu=0.5, mean_image_bytes=100_000, shard_bytes=10**9, global_batch=256,
                     micro_batch=16, cache_limit_bytes=10e9, node_read_bandwidth=10e9, offload_optimizer=True)


def test_plan_puts_the_figures_together():
    inputs = _small()
    result = plan(inputs)
    p, per_gpu = result["parameters"], result["images_per_s_per_gpu"]
    compute = 256 / 8 / per_gpu
    assert result["micro_steps"] == 2 and result["compute_s_per_step"] == pytest.approx(compute)
    latency = 8.4e-6 + 6 * 3.4e-6 + 9.6e-6
    for stage, passes, traversals in ((0, 2, 2), (2, 3, 3), (3, 6, 2 * (2 * 2 + 1))):
        c = result["communication"][stage]
        comm = passes * 7 / 8 * 2 * p / 400e9 + traversals * latency
        assert c["comm_s"] == pytest.approx(comm)
        assert c["step_s"] == pytest.approx(compute + comm)
        assert c["effective_mfu"] == pytest.approx(0.5 * compute / (compute + comm))
        assert c["run_hours"] == pytest.approx(10_000_000 * 2 / 256 * (compute + comm) / 3600)
    # Restart: 125 shards per rank of 10,000 images at 64 bytes, 4 ranks a node, read at
    # min(10 GB/s, 50 GB/s / 2 nodes).
    assert result["shards"] == 1000 and result["shards_per_rank"] == 125
    restart = result["checkpoint"][3]["restart"]
    assert restart["index_s"] == pytest.approx(4 * 125 * 10_000 * 64 / 10e9)
    assert restart["checkpoint_s"] == pytest.approx(4 * 14 * p / 8 / 10e9)
    assert restart["total_s"] == pytest.approx(restart["index_s"] + restart["checkpoint_s"] + 60)
    # Host memory: the 10 GB cache holds 10 shards of 1 GB, shared by 4 ranks.
    host = result["host_memory"][3]
    assert host["per_rank"]["cache"] == pytest.approx(10e9 / 4)
    assert host["per_rank"]["index"] == 125 * 10_000 * 64 and host["per_rank"]["offload"] == pytest.approx(16 * p / 8)
    assert host["per_node"] == pytest.approx(4 * host["per_rank"]["total"]) and host["fits"]


def test_report_prints_communication_restart_and_host_memory():
    inputs = _small()
    text = report(inputs, plan(inputs))
    for needed in ("per rank per step", "effective MFU", "if all hidden", "restart", "warm-up 60 s",
                   "host memory per rank", "checkpoint staging", "per node, fits"):
        assert needed in text, needed
    assert text.count("ZeRO-3:") == 3  # communication, checkpoints, host memory
    tight = PlanInput(**{**inputs.__dict__, "node_ram_bytes": 1e9})
    assert "OVER the node RAM" in report(tight, plan(tight))


@pytest.mark.parametrize("field, value", [("nvlink_bandwidth", -1.0), ("network_bandwidth", 0.0),
                                          ("node_read_bandwidth", -5e9), ("comm_overlap", 1.5),
                                          ("comm_overlap", -0.1), ("warmup_s", -1.0), ("cache_limit_bytes", 0.0),
                                          ("node_ram_bytes", -1.0), ("shards_ahead", -1), ("global_batch", 4)])
def test_bad_inputs_name_the_field(field, value):
    with pytest.raises(UsageError, match=field):
        PlanInput(nodes=1, gpus_per_node=8, **{field: value})


def test_paper_setup_is_several_times_slower_at_zero3_than_compute_alone():
    """ViT-H/14 on 64 nodes x 8 H100, 300M images, 7 epochs: ZeRO-3 gathers the model twice and
    reduce-scatters it once per step across 512 ranks, in 28 ring traversals of 511 steps each."""
    result = plan(PlanInput(model="vit_huge_patch14_224", dataset_images=300_000_000, epochs=7, nodes=64,
                            gpus_per_node=8, device="H100"))
    p, compute = result["parameters"], result["compute_s_per_step"]
    traversals = 2 * math.ceil(p / 5e7) + math.ceil(p / 5e8)
    comm = 3 * 511 / 512 * 2 * p / 400e9 + traversals * (8.4e-6 + 448 * 3.4e-6 + 63 * 9.6e-6)
    zero3, zero2 = result["communication"][3], result["communication"][2]
    assert zero3["run_hours"] / result["run_hours"] == pytest.approx((compute + comm) / compute)
    assert (compute + comm) / compute > 3  # several times the compute-only estimate
    assert result["run_hours"] < zero2["run_hours"] < zero3["run_hours"]
    assert zero3["effective_mfu"] < zero2["effective_mfu"] < 0.4
