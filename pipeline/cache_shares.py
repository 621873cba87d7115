"""One node cache bound (data.cache_gb) shared out among a mixture's sources.

Each source keeps its own cache folder, with its share as its bound, so the shares together never
exceed the one bound. A share is worth most where its bytes are read most often: a source cycles
its own epochs, so each of its bytes is read once per pass, and a pass of a source of N samples
drawn at weight w lasts N / w samples of the mixture. A cached byte of that source therefore saves
w / N bytes of egress per sample drawn, whatever its images weigh. So, when the bound holds every
source's working set (what its readers hold open and read ahead), each gets that first, then the
rest goes to sources in order of w / N, each up to all it reads on the node: small, heavily drawn
sources are cached whole, a huge web crawl read about once streams through what is left. A local
source (no object store) reads no cache and gets none. When the bound cannot hold every working
set, the shares go by weight: every source then streams some shards from the store (with one
warning), the high-weight ones least.

This is a split fixed at start, not one folder with one eviction order: eviction compares when the
node next reads each shard, and a source's loader knows that only for its own shards. O(sources).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheDemand:
    """What one source asks of a node's cache."""
    weight: float  # its weight in the mixture (any positive scale)
    samples: int  # its samples: its reads per cached byte go as weight / samples
    node_bytes: float  # what one node reads of it in a pass (math.inf when unknown; 0: it reads no cache)
    working_bytes: float  # what that node's readers hold open and read ahead of it (its shards x (1 + ahead))


def node_cache_shares(limit_bytes: int, demands: list[CacheDemand]) -> list[int]:
    """Each source's bytes of the node cache, summing to at most `limit_bytes` (see the module)."""
    cached = [i for i, d in enumerate(demands) if d.node_bytes > 0]
    shares = [0] * len(demands)
    floors = {i: min(demands[i].node_bytes, demands[i].working_bytes) for i in cached}
    if sum(floors.values()) > limit_bytes:
        weight = sum(demands[i].weight for i in cached)
        for i in cached:
            shares[i] = int(limit_bytes * demands[i].weight / weight)
        return shares
    left = limit_bytes - sum(floors.values())
    for i in sorted(cached, key=lambda i: (-demands[i].weight / demands[i].samples, i)):
        extra = min(left, demands[i].node_bytes - floors[i])
        shares[i], left = int(floors[i] + extra), left - extra
    return shares


def node_bytes(total_bytes: float, largest_shard: float, ranks_per_node: int, world_size: int) -> float:
    """What one node reads of a dataset in a pass: its ranks' share of the bytes, plus one shard
    where its partitions begin and end mid-shard, at most the whole dataset."""
    if not math.isfinite(total_bytes):
        return total_bytes
    return min(total_bytes, total_bytes * ranks_per_node / world_size + largest_shard)
