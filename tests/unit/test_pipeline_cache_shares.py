"""node_cache_shares: a mixture's sources share one node cache bound: working sets first, then
the sources read most often per byte, none to a local source, by weight (capped at what each
needs) when the bound is short."""

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
    # by weight, but none above what the node reads of a source: a 1 GB curated set keeps all of
    # it and the crawl (whose working set alone is over the bound) the rest
    crawl = CacheDemand(0.5, 10**8, 1000 * GB, 70 * GB)
    assert node_cache_shares(64 * GB, [crawl, CacheDemand(0.5, 10**6, 1 * GB, 3 * GB)]) == [63 * GB, 1 * GB]
    # a cap that frees room for the others, by weight, in turn
    three = [CacheDemand(1, 10, 1 * GB, 5 * GB), CacheDemand(2, 10, 100 * GB, 50 * GB),
             CacheDemand(1, 10, 100 * GB, 50 * GB)]
    assert node_cache_shares(61 * GB, three) == [1 * GB, 40 * GB, 20 * GB]


def test_a_source_of_unknown_sizes_takes_what_is_left_in_its_turn():
    # tars made elsewhere: no working set to reserve and no cap; the 1 GB curated set, read most
    # often per byte, is cached whole first, the unknown-size crawl takes the rest
    unknown = CacheDemand(0.99, 10**8, math.inf, 0)
    curated = CacheDemand(0.01, 10**4, 1 * GB, 0.5 * GB)
    assert node_cache_shares(64 * GB, [unknown, curated]) == [63 * GB, 1 * GB]
    # read more often per byte than a known source: the known one still keeps its working set
    small = [CacheDemand(0.5, 10, math.inf, 0), CacheDemand(0.5, 1000, 50 * GB, 3 * GB)]
    assert node_cache_shares(8 * GB, small) == [5 * GB, 3 * GB]
    assert node_cache_shares(2 * GB, small) == [1 * GB, 1 * GB]  # below that working set: by weight


def test_the_shares_never_exceed_the_bound():
    demands = [CacheDemand(w, n, b * GB, k * GB) for w, n, b, k in
               ((0.6, 300, 70, 3), (0.3, 20, 9, 3), (0.1, 5, 2, 3), (1e-6, 10**9, 1e4, 3))]
    for limit in (1, 5, 12, 13, 20, 90, 10**4):
        shares = node_cache_shares(limit * GB, demands)
        assert sum(shares) <= limit * GB and min(shares) >= 0, (limit, shares)
