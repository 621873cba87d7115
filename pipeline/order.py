"""The epoch's sample order and its split over ranks: pure functions of (seed, epoch, sizes, partitions).

Partitions: the shards, in one seeded order fixed for the run, are cut into P contiguous runs of
equal sample counts (within one); P is fixed when the run starts. Each epoch, inside each partition,
the shards are permuted, the samples permuted within each shard, then mixed within windows of
`shuffle_window` positions (a shuffle buffer without the buffer). The epoch's global order
interleaves the partitions: position j holds sample j // P of partition j % P.

Ranks take every W-th position: batch b of rank r is positions c + b*W*B + r + W*i (i < B), from
the epoch's start position c. So after k steps the ranks together have consumed exactly the first
k*W*B positions, whatever W and B are: resuming is exact at any world size or batch size. And
rank r only ever reads partitions p = r (mod W) when W divides P: each partition, so each shard
(but the one or two at a partition's ends), is read by one rank, so by one node per epoch; store
egress stays one copy of the dataset whatever the node count. With gradient accumulation an
optimizer step is A consecutive batches, i.e. the W*B*A positions of one global batch, and epochs
end on whole optimizer steps.

Each partition's order is computed from that partition alone (its members follow from the
shards' sample counts), so a rank holds and sorts N / P samples per epoch, never all N: at 300M
samples in 512 partitions, 586,000. Which sample a position holds is exactly what one global sort
of all N gave before (loader state version 2): a run resumes with its own order.

Hashing instead of a seeded generator keeps the order identical across numpy versions.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(*parts) -> np.ndarray:
    """splitmix64 of the combined parts, vectorised: a fixed, portable pseudo-random hash."""
    with np.errstate(over="ignore"):
        x = np.zeros(np.broadcast(*[np.asarray(p) for p in parts]).shape, dtype=np.uint64)
        for p in parts:
            x = (x ^ np.asarray(p, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            x = x + np.uint64(0x632BE59BD9B4E5B3)
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
        return x & _MASK


def partition_starts(num_samples: int, partitions: int) -> np.ndarray:
    """First position of each of `partitions` contiguous runs of equal size (the first ones one more)."""
    size, extra = divmod(num_samples, partitions)
    p = np.arange(partitions, dtype=np.int64)
    return p * size + np.minimum(p, extra)


def shard_layout(seed: int, num_shards: int) -> np.ndarray:
    """The shards in the run's fixed layout order (the partitions cut it into runs)."""
    shards = np.arange(num_shards, dtype=np.uint64)
    return np.lexsort((shards, mix(seed, 5, shards)))


def partition_shards(
    counts: np.ndarray, seed: int, partitions: int, part: int, layout: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, first row, rows) of each shard run in one partition, in layout order; `counts`:
    samples per shard, `layout`: shard_layout's, when the caller has it. O(shards)."""
    layout = shard_layout(seed, len(counts)) if layout is None else layout
    ends = np.cumsum(counts[layout])
    begins = ends - counts[layout]
    starts = partition_starts(int(ends[-1]) if len(ends) else 0, partitions)
    lo = int(starts[part])
    hi = int(starts[part + 1]) if part + 1 < partitions else int(ends[-1])
    inside = np.flatnonzero((begins < hi) & (ends > lo))
    first = np.maximum(lo - begins[inside], 0)
    return layout[inside], first, np.minimum(hi - begins[inside], counts[layout][inside]) - first


def partition_shards_of(counts: np.ndarray, seed: int, partitions: int, parts) -> np.ndarray:
    """The shards these partitions hold, ascending. O(shards) per partition."""
    layout = shard_layout(seed, len(counts))
    held = [partition_shards(counts, seed, partitions, int(p), layout) for p in parts]
    return np.unique(np.concatenate([shards[taken > 0] for shards, _, taken in held] or [np.empty(0, np.int64)]))


def partition_members(counts: np.ndarray, seed: int, partitions: int, part: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard, row) of each sample of one partition, in sample-id order. O(partition) memory."""
    shards, first, taken = partition_shards(counts, seed, partitions, part)
    # Each shard's rows first..first+taken-1: a running count, restarted at each shard's first row.
    rows = np.arange(int(taken.sum()), dtype=np.int64) + np.repeat(first - (np.cumsum(taken) - taken), taken)
    shards = np.repeat(shards, taken).astype(np.int32)
    by_id = np.lexsort((rows, shards))
    return shards[by_id], rows[by_id]


def partition_order(
    counts: np.ndarray, seed: int, epoch: int, window: int, partitions: int, part: int
) -> tuple[np.ndarray, np.ndarray]:
    """(shard, row) of one partition's samples in this epoch's order, from that partition alone:
    the shards permuted, the samples within each shard, then mixed within windows. About 40 bytes
    per sample of the partition while it is computed, 12 kept (N / P samples: 586,000 for 300M
    samples in 512 partitions)."""
    shards, rows = partition_members(counts, seed, partitions, part)
    offsets = np.cumsum(counts) - counts  # sample id of each shard's first sample
    ids = (offsets[shards] + rows).astype(np.uint64)
    order = np.lexsort((mix(seed, epoch, 2, ids), mix(seed, epoch, 1, shards)))
    if window > 1:
        k = np.arange(len(order), dtype=np.int64)
        first = int(partition_starts(int(counts.sum()), partitions)[part])
        order = order[np.lexsort((mix(seed, epoch, 3, (first + k).astype(np.uint64)), k // window))]
    return shards[order], rows[order]


class EpochOrder:
    """The epoch's order at any position of the given partitions: position j holds sample j // P
    of partition j % P. Holds the order of those partitions only (12 bytes per sample; one
    partition of N / P samples per rank when the world size divides P)."""

    def __init__(self, counts: np.ndarray, seed: int, epoch: int, window: int, partitions: int, parts):
        self.num_samples, self.partitions = int(counts.sum()), partitions
        self._orders = {int(p): partition_order(counts, seed, epoch, window, partitions, int(p)) for p in parts}

    @property
    def samples(self) -> int:
        """Samples whose place this order holds."""
        return sum(len(shards) for shards, _ in self._orders.values())

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of the samples at these epoch positions; past the end they wrap (padding)."""
        j = np.asarray(positions, np.int64) % self.num_samples
        parts, k = j % self.partitions, j // self.partitions
        shards, rows = np.empty(len(j), np.int32), np.empty(len(j), np.int64)
        for p in np.unique(parts):
            if int(p) not in self._orders:
                raise ValueError(f"partition {p} was not computed for this order (only {sorted(self._orders)})")
            mask = parts == p
            part_shards, part_rows = self._orders[int(p)]
            shards[mask], rows[mask] = part_shards[k[mask]], part_rows[k[mask]]
        return shards, rows


def shard_uses(
    counts: np.ndarray,
    seed: int,
    epoch: int,
    window: int,
    partitions: int,
    parts,
    below: int | None = None,
    shift: int = 0,
) -> dict[int, list[tuple[int, int]]]:
    """For each shard of these partitions, the (first, last) epoch positions at which they read
    it: a shard's samples are one run of its partition's order before the window mixing, which
    moves a sample only within its window of `window` positions. From shard counts alone: O(shards).
    `below`: only uses at positions below it, moved `shift` on (padding: the order's start again)."""
    uses: dict[int, list[tuple[int, int]]] = {}
    below = int(counts.sum()) if below is None else below
    size = int(counts.sum())
    width = max(window, 1)
    layout = shard_layout(seed, len(counts))
    for part in parts:
        present, _, count = partition_shards(counts, seed, partitions, int(part), layout)
        present, count = present[count > 0], count[count > 0]
        by_key = np.lexsort((present, mix(seed, epoch, 1, present)))
        present, count = present[by_key], count[by_key]
        last = np.cumsum(count) - 1
        first = (last - count + 1) // width * width
        last = np.minimum((last // width + 1) * width, int(count.sum())) - 1
        for shard, a, b in zip(present.tolist(), first.tolist(), last.tolist()):
            first_use, last_use = a * partitions + int(part), min(b * partitions + int(part), size - 1, below - 1)
            if first_use <= last_use:
                uses.setdefault(shard, []).append((first_use + shift, last_use + shift))
    return uses


def subset_counts(counts: np.ndarray, size: float | int, seed: int) -> np.ndarray:
    """How many samples of each shard a subset keeps: a fraction (float, 0 < size <= 1) or a
    count (int) of all samples, apportioned over the shards by D'Hondt's method (the `count`
    largest of counts[s] / k, k = 1, 2... ties to the lower shard). That is house-monotone: no
    shard loses samples when the subset grows, so with subset_rows every smaller subset is inside
    every larger one (10% within 30%), as a data-scale study needs. O(shards)."""
    total = int(counts.sum())
    wanted = round(size * total) if isinstance(size, float) else size
    if not 1 <= wanted <= total:
        raise ValueError(
            f"subset {size!r} selects {wanted} of {total} samples; give a fraction in (0, 1] "
            f"or a count from 1 to {total}"
        )
    counts = np.asarray(counts, np.int64)
    quota = counts * wanted // total  # every k with counts/k >= total/wanted: a prefix of the ranking
    rest = wanted - int(quota.sum())
    if rest == 0:
        return quota

    def priority(n: int, k: int) -> int:
        # counts/k scaled by 2**64 and floored: exact order, since two different ratios of numbers
        # below 2**32 differ by more than 2**-64.
        return -((n << 64) // k)

    heap = [(priority(int(n), int(q) + 1), s) for s, (n, q) in enumerate(zip(counts, quota)) if q < n]
    heapq.heapify(heap)
    for _ in range(rest):
        _, shard = heapq.heappop(heap)
        quota[shard] += 1
        if quota[shard] < counts[shard]:
            heapq.heappush(heap, (priority(int(counts[shard]), int(quota[shard]) + 1), shard))
    return quota


def subset_rows(counts: np.ndarray, shard: int, keep: int, seed: int) -> np.ndarray:
    """The rows of one shard a subset keeps, ascending: the `keep` whose hash of their sample id
    is smallest (so a larger subset's rows of the shard contain a smaller one's)."""
    first = int(counts[:shard].sum())
    ranking = np.argsort(mix(seed, 4, np.arange(first, first + int(counts[shard]), dtype=np.uint64)), kind="stable")
    return np.sort(ranking[:keep])


def ranked_subset_ids(num_samples: int, size: float | int, seed: int) -> np.ndarray:
    """Loader state version 2's subsets (kept so that such a run resumes with its own samples):
    the first samples of one ranking of all of them, ascending sample ids. O(N) per rank."""
    count = round(size * num_samples) if isinstance(size, float) else size
    if not 1 <= count <= num_samples:
        raise ValueError(
            f"subset {size!r} selects {count} of {num_samples} samples; give a fraction in (0, 1] "
            f"or a count from 1 to {num_samples}"
        )
    ranking = np.argsort(mix(seed, 4, np.arange(num_samples, dtype=np.uint64)), kind="stable")
    return np.sort(ranking[:count])


@dataclass(frozen=True)
class RankSlice:
    """The batches one rank draws from an epoch that started `consumed` positions in."""

    num_samples: int
    consumed: int
    rank: int
    world_size: int
    batch_size: int
    epoch_end: str
    accumulation: int = 1  # micro-batches per optimizer step: epochs end on whole optimizer steps
    partitions: int = 1
    ranks_per_node: int = 1  # ranks share a node when they share rank // ranks_per_node

    @property
    def num_batches(self) -> int:
        remaining = max(self.num_samples - self.consumed, 0)
        per_step = self.world_size * self.batch_size * self.accumulation
        steps = -(-remaining // per_step) if self.epoch_end == "pad" else remaining // per_step
        return steps * self.accumulation

    def positions(self, batch: int) -> np.ndarray:
        """Epoch positions of one batch; positions past the end wrap to the start (padding)."""
        first = self.consumed + batch * self.world_size * self.batch_size + self.rank
        return np.arange(first, first + self.world_size * self.batch_size, self.world_size, dtype=np.int64)

    def partitions_read(self, rank: int | None = None, padding: bool = True) -> np.ndarray:
        """The partitions this rank (or another `rank` of the run) reads in the rest of the epoch,
        ascending: those p = first position (mod gcd(W, P)), and, past the end, the padding's
        (only those with `padding`). O(P / gcd(W, P)): one when the world size divides P."""
        rank = self.rank if rank is None else rank
        first = self.consumed + rank
        count = self.num_batches * self.batch_size
        step, parts = self.world_size, self.partitions
        within = min(count, max(0, -(-(self.num_samples - first) // step)))  # positions before the end
        spread = math.gcd(step, parts)
        # Positions first + W*i (i < within) meet each partition p = first (mod gcd(W, P)) once i spans P / gcd.
        head = (
            np.arange(first % spread, parts, spread)
            if within >= parts // spread
            else (first + step * np.arange(within, dtype=np.int64)) % parts
        )
        padded = (first + step * np.arange(within, count, dtype=np.int64)) % self.num_samples % parts
        return np.unique(np.concatenate([head, padded] if padding else [head]).astype(np.int64))

    @property
    def end(self) -> int:
        """The epoch position after the last one the ranks read (past num_samples when padded)."""
        return self.consumed + self.num_batches * self.world_size * self.batch_size

    def node_ranks(self) -> range:
        node = self.rank // self.ranks_per_node
        return range(node * self.ranks_per_node, min((node + 1) * self.ranks_per_node, self.world_size))
