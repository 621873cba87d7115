"""`vitforge plan`: every formula against a hand calculation, and the ViT paper's own compute."""

from __future__ import annotations

import json
import math

import pytest

from common.cli import vitforge
from vitforge.cluster import PlanInput, plan
from vitforge.cluster.planner import (checkpoint_bytes_per_rank, intervals_within, lost_fraction, throughput,
                                   write_seconds, young_daly_interval)
from vitforge.core import errors


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


@pytest.mark.slow
def test_plan_cli_prints_and_refuses_bad_input():
    text = vitforge("plan", "--nodes", "4", "--device", "H200", "--comm-overlap", "0.5", "--offload-optimizer").stdout
    assert "4 nodes x 8 H200" in text and "ZeRO-3:" in text and "Young interval" in text
    assert "50% hidden behind compute" in text and "effective MFU" in text and "restart" in text
    assert "host memory per rank" in text and "offload 0.00 GB" in text.split("ZeRO-0:")[-1]  # stage 0: no offload
    assert "offload 0.00 GB" not in text.split("host memory")[1].split("ZeRO-3:")[1]
    figures = json.loads(vitforge("plan", "--nodes", "4", "--json").stdout)
    assert figures["gpus"] == 32 and figures["inputs"]["nodes"] == 4
    bad = vitforge("plan", "--device", "TPU9000", check=False)
    assert bad.returncode == errors.USAGE and "known devices are" in bad.stderr and "Traceback" not in bad.stderr


def test_a_mixture_plan_gives_each_source_its_share_of_the_samples_egress_and_cache():
    figures = json.loads(vitforge("plan", "--nodes", "2", "--epochs", "3", "--mean-image-bytes", "100000",
                                  "--shard-bytes", "1000000000", "--cache-limit-bytes", "60e9",
                                  "--mixture", "4000000:3", "1000000:1", "--json").stdout)
    assert figures["inputs"]["dataset_images"] == 5_000_000
    samples = figures["steps"] * 4096  # 3 passes over the sum: 15M samples
    big, small = figures["mixture"]
    assert math.isclose(big["samples"], 0.75 * samples) and math.isclose(small["samples"], 0.25 * samples)
    assert math.isclose(big["passes"], 0.75 * 15e6 / 4e6) and math.isclose(small["passes"], 3.75)
    assert big["shards"] == 400 and small["shards"] == 100
    # 4M samples at 0.75 x 4096 a step, 1M at 0.25 x 4096: where each source's first pass ends
    assert big["first_pass_step"] == 1303 and small["first_pass_step"] == 977
    # Each node's 8 ranks hold 1 shard open and 2 ahead of each source (24 GB); the other 12 GB go
    # to the small source, whose bytes are read more often (3.75 passes against 2.81).
    assert big["cache_bytes_per_node"] == 24e9 and small["cache_bytes_per_node"] == 36e9
    assert math.isclose(big["egress_bytes"], 0.75 * 15e6 * 100_000)  # its cache keeps nothing between passes
    # ceil(100 / 2) + 1 shards per node a pass: the first fetched whole, the next 2.75 all but 12 of 51 GB
    assert math.isclose(small["egress_bytes_per_node"], (1 + 2.75 * (1 - 12 / 51)) * 51e9)
    roomy = json.loads(vitforge("plan", "--nodes", "2", "--epochs", "3", "--mean-image-bytes", "100000",
                                "--shard-bytes", "1000000000", "--cache-limit-bytes", "100e9",
                                "--mixture", "4000000:3", "1000000:1", "--json").stdout)["mixture"]
    # room for all 51 GB the node reads of the small source: fetched once, then read from the cache
    assert roomy[1]["cache_bytes_per_node"] == 51e9 and roomy[1]["cache_kept_fraction"] == 1
    assert math.isclose(roomy[1]["egress_bytes_per_node"], 51e9)
    assert roomy[0]["cache_bytes_per_node"] == 49e9
    text = vitforge("plan", "--mixture", "4000000:3", "1000000:1").stdout
    assert "source 0: 4,000,000 images at weight 3 (75.0% of every batch)" in text
    assert "passes over it (the first ends at step 1,303)" in text
    bad = vitforge("plan", "--mixture", "100:0", check=False)
    assert bad.returncode == errors.USAGE and "--mixture '100:0'" in bad.stderr
