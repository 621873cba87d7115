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

Hashing instead of a seeded generator keeps the order identical across numpy versions.
"""

from __future__ import annotations

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


def epoch_order(shard_of_sample: np.ndarray, seed: int, epoch: int, window: int, partitions: int = 1) -> np.ndarray:
    """Sample ids in this epoch's order (for one partition, the order of the shuffle alone)."""
    n = len(shard_of_sample)
    ids = np.arange(n, dtype=np.uint64)
    shards = np.arange(shard_of_sample.max() + 1, dtype=np.uint64)
    starts = partition_starts(n, partitions)
    layout = np.lexsort((ids, mix(seed, 5, shards)[shard_of_sample]))  # fixed for the run
    part = np.empty(n, np.int64)
    part[layout] = np.searchsorted(starts, np.arange(n), side="right") - 1
    shard_key = mix(seed, epoch, 1, shards)
    order = np.lexsort((mix(seed, epoch, 2, ids), shard_key[shard_of_sample], part))
    if window > 1:
        positions = np.arange(n, dtype=np.int64)
        in_partition = positions - starts[part[order]]
        order = order[np.lexsort((mix(seed, epoch, 3, positions.astype(np.uint64)), in_partition // window,
                                  part[order]))]
    j = np.arange(n, dtype=np.int64)
    return order[starts[j % partitions] + j // partitions]


def subset_ids(num_samples: int, size: float | int, seed: int) -> np.ndarray:
    """The samples of a deterministic subset, ascending: a fraction (float, 0 < size <= 1) or a
    count (int) of the first samples of one fixed ranking of all of them per seed. Every smaller
    subset is therefore inside every larger one (10% within 30%), as a data-scale study needs."""
    count = round(size * num_samples) if isinstance(size, float) else size
    if not 1 <= count <= num_samples:
        raise ValueError(f"subset {size!r} selects {count} of {num_samples} samples; give a fraction in (0, 1] "
                         f"or a count from 1 to {num_samples}")
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

    def node_positions(self) -> np.ndarray:
        """The epoch positions that this rank's node (all its ranks) will read, ascending."""
        node = self.rank // self.ranks_per_node
        ranks = range(node * self.ranks_per_node, min((node + 1) * self.ranks_per_node, self.world_size))
        count = self.num_batches * self.world_size * self.batch_size
        offsets = np.arange(count, dtype=np.int64)
        return self.consumed + offsets[np.isin(offsets % self.world_size, ranks)]
