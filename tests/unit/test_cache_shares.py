"""node_cache_shares: a mixture's sources share one node cache bound: working sets first, then
the sources read most often per byte, none to a local source, by weight when the bound is short."""

from __future__ import annotations

import math

from vitforge.pipeline import CacheDemand, node_cache_shares

GB = 10**9


def test_working_sets_first_then_the_sources_read_most_often_per_byte():
    # a 1 GB curated set at weight 0.3 (read 0.3 / 1M per sample), a 100 GB crawl at 0.7 (0.7 / 100M)
    curated = CacheDemand(0.3, 1_000_000, 1 * GB, 0.2 * GB)
    crawl = CacheDemand(0.7, 100_000_000, 100 * GB, 0.2 * GB)
    assert node_cache_shares(10 * GB, [crawl, curated]) == [9 * GB, 1 * GB]  # the curated set whole
    # the crawl keeps its working set when the curated set could use everything left
    assert node_cache_shares(int(0.9 * GB), [crawl, curated]) == [int(0.2 * GB), int(0.7 * GB)]
    # everything fits: each gets what the node reads of it, the rest stays unused
    assert node_cache_shares(500 * GB, [crawl, curated]) == [100 * GB, 1 * GB]


def test_a_local_source_gets_none_and_a_short_bound_goes_by_weight():
    local = CacheDemand(0.5, 1000, 0, 0)
    remote = CacheDemand(0.5, 1000, 50 * GB, 3 * GB)
    assert node_cache_shares(8 * GB, [local, remote]) == [0, 8 * GB]
    big = CacheDemand(3, 1000, 50 * GB, 6 * GB)
    # 2 working sets of 6 GB do not fit in 8: by weight, 3 to 1 (each streams some shards)
    assert node_cache_shares(8 * GB, [big, CacheDemand(1, 1000, 50 * GB, 6 * GB)]) == [6 * GB, 2 * GB]
    # sizes unknown (tars made elsewhere): by weight
    assert node_cache_shares(8 * GB, [CacheDemand(0.5, 10, math.inf, math.inf), remote]) == [4 * GB, 4 * GB]


def test_the_shares_never_exceed_the_bound():
    demands = [CacheDemand(w, n, b * GB, k * GB) for w, n, b, k in
               ((0.6, 300, 70, 3), (0.3, 20, 9, 3), (0.1, 5, 2, 3), (1e-6, 10**9, 1e4, 3))]
    for limit in (1, 5, 12, 13, 20, 90, 10**4):
        shares = node_cache_shares(limit * GB, demands)
        assert sum(shares) <= limit * GB and min(shares) >= 0, (limit, shares)
