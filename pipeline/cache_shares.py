"""One node cache bound (data.cache_gb) shared out among a mixture's sources.

Each source keeps its own cache folder, with its share as its bound, so the shares together never
exceed the one bound. A share is worth most where its bytes are read most often: a source cycles
its own epochs, so each of its bytes is read once per pass, and a pass of a source of N samples
drawn at weight w lasts N / w samples of the mixture. A cached byte of that source therefore saves
w / N bytes of egress per sample drawn, whatever its images weigh. So, when the bound holds every
source's working set (what its readers hold open and read ahead), each gets that first, then the
rest goes to sources in order of w / N, each up to all the node reads of it: small, heavily drawn
sources are cached whole, a huge web crawl read about once streams through what is left. A local
source (no object store) reads no cache and gets none. A source whose shard sizes are unknown
(tars made elsewhere) has no working set to reserve and no cap: it takes what is left in its turn.
When the bound cannot hold every working set, the shares go by weight, none above what the node
reads of its source (what that frees goes to the others by weight): every source then streams
some shards from the store (with one warning), the high-weight ones least.

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
    working_bytes: float  # what that node's readers hold open and read ahead of it (0 when unknown)


def node_cache_shares(limit_bytes: int, demands: list[CacheDemand]) -> list[int]:
    """Each source's bytes of the node cache, summing to at most `limit_bytes` (see the module)."""
    cached = [i for i, d in enumerate(demands) if d.node_bytes > 0]
    shares = [0] * len(demands)
    floors = {i: min(demands[i].node_bytes, demands[i].working_bytes) for i in cached}
    if sum(floors.values()) > limit_bytes:
        return _by_weight(limit_bytes, demands, cached)
    left = limit_bytes - sum(floors.values())
    for i in sorted(cached, key=lambda i: (-demands[i].weight / demands[i].samples, i)):
        extra = min(left, demands[i].node_bytes - floors[i])
        shares[i], left = int(floors[i] + extra), left - extra
    return shares


def _by_weight(limit_bytes: int, demands: list[CacheDemand], cached: list[int]) -> list[int]:
    """`limit_bytes` split by weight among `cached`, none above its node_bytes: a source capped
    gives what it cannot use to the others, by weight (at most one round per source)."""
    shares = [0] * len(demands)
    open_, left = list(cached), float(limit_bytes)
    while open_:
        weight = sum(demands[i].weight for i in open_)
        capped = [i for i in open_ if demands[i].node_bytes <= left * demands[i].weight / weight]
        if not capped:
            for i in open_:
                shares[i] = math.floor(left * demands[i].weight / weight)
            break
        for i in capped:
            shares[i] = int(demands[i].node_bytes)
            left -= demands[i].node_bytes
        open_ = [i for i in open_ if i not in capped]
    return shares
