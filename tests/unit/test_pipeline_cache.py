"""The node shard cache's footprint (pipeline/cache.py): how many shards a node holds, how many it
reads ahead, and when its readers stream instead. (The cache itself on a real S3 server:
tests/integration/test_cache_bound.py.)"""

from __future__ import annotations

import pytest

from vitforge.pipeline import cache_footprint


def test_cache_footprint_rule():
    gb = 10**9
    paper = cache_footprint(int(3.3 * gb), 8, 2, 64 * gb)
    assert (paper.shards, paper.ahead, paper.streams) == (19, 1, False)
    assert paper.working_bytes == 8 * 2 * int(3.3 * gb) and paper.peak_bytes == 19 * int(3.3 * gb) <= 64 * gb
    window = cache_footprint(int(3.3 * gb), 8, 2, 64 * gb, open_shards=3)  # a window spanning ~2.6 shards
    assert window.streams and window.ahead == 0 and window.working_bytes == window.peak_bytes
    tiny = cache_footprint(100, 4, 3, 99)  # not one shard fits: every reader streams
    assert (tiny.shards, tiny.ahead, tiny.peak_bytes, tiny.streams) == (0, 0, 0, True)
    with pytest.raises(ValueError, match="shard_bytes > 0"):
        cache_footprint(0, 8, 2, 64 * gb)
