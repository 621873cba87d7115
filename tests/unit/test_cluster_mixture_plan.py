"""`vitforge plan --mixture` (cluster/mixture_plan.py): each source's share of the samples, its
passes, shards, egress and node cache, as the figures and as the report; a bad source refused."""

from __future__ import annotations

import json
import math

from common.cli import vitforge
from vitforge.core import errors


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
