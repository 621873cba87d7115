"""The epoch order made per partition (pipeline/order.py): the same samples in the same order as one
global sort of all N (loader state version 2), while a rank computes only the partitions it reads,
and the uses counted for each shard bound every read of it."""

from __future__ import annotations

import numpy as np
import pytest

from vitforge.pipeline.order import EpochOrder, RankSlice, mix, partition_starts, shard_uses


def global_order(shard_of_sample, seed, epoch, window, partitions):
    """The order as version 2 made it: one sort of every sample of the dataset on every rank. The
    reference the per-partition order must equal, position by position."""
    n = len(shard_of_sample)
    ids = np.arange(n, dtype=np.uint64)
    shards = np.arange(shard_of_sample.max() + 1, dtype=np.uint64)
    starts = partition_starts(n, partitions)
    layout = np.lexsort((ids, mix(seed, 5, shards)[shard_of_sample]))
    part = np.empty(n, np.int64)
    part[layout] = np.searchsorted(starts, np.arange(n), side="right") - 1
    order = np.lexsort((mix(seed, epoch, 2, ids), mix(seed, epoch, 1, shards)[shard_of_sample], part))
    if window > 1:
        positions = np.arange(n, dtype=np.int64)
        in_partition = positions - starts[part[order]]
        order = order[np.lexsort((mix(seed, epoch, 3, positions.astype(np.uint64)), in_partition // window,
                                  part[order]))]
    j = np.arange(n, dtype=np.int64)
    return order[starts[j % partitions] + j // partitions]


def test_the_order_per_partition_is_the_global_order_position_by_position():
    rng = np.random.default_rng(0)
    for _ in range(40):
        counts = rng.integers(0, 40, int(rng.integers(1, 12))).astype(np.int64)
        counts[0] += 1
        n = int(counts.sum())
        partitions, window = min(int(rng.integers(1, 7)), n), int(rng.choice([1, 3, 16]))
        seed, epoch = int(rng.integers(0, 100)), int(rng.integers(0, 3))
        want = global_order(np.repeat(np.arange(len(counts)), counts), seed, epoch, window, partitions)
        shards, rows = EpochOrder(counts, seed, epoch, window, partitions, range(partitions)).at(np.arange(n))
        assert np.array_equal((np.cumsum(counts) - counts)[shards] + rows, want)
        # Each partition alone gives its positions; positions past the end wrap (padding).
        for part in range(partitions):
            alone = EpochOrder(counts, seed, epoch, window, partitions, [part])
            mine = np.arange(part, n, partitions)
            assert np.array_equal(alone.at(mine)[0], shards[mine]) and np.array_equal(alone.at(mine + n)[1],
                                                                                      rows[mine])
            if partitions > 1:
                with pytest.raises(ValueError, match="not computed"):
                    alone.at(np.arange(n))


@pytest.mark.parametrize("world,partitions", [(1, 1), (2, 2), (3, 3), (2, 4), (3, 4), (4, 2)])
@pytest.mark.parametrize("epoch_end", ["pad", "drop"])
def test_a_rank_computes_exactly_the_partitions_it_reads(world, partitions, epoch_end):
    for consumed in (0, 24, 96):
        for rank in range(world):
            rank_slice = RankSlice(101, consumed, rank, world, 8, epoch_end, 1, partitions)
            positions = np.concatenate([rank_slice.positions(b) for b in range(rank_slice.num_batches)] +
                                       [np.empty(0, np.int64)])
            assert set(rank_slice.partitions_read().tolist()) == set((positions % 101 % partitions).tolist())


def test_shard_uses_bound_every_read_of_every_shard():
    counts = np.array([17, 17, 3, 40, 0, 25], np.int64)
    for window in (1, 5, 64):
        order = EpochOrder(counts, 4, 1, window, 3, range(3))
        shards, _ = order.at(np.arange(int(counts.sum())))
        uses = shard_uses(counts, 4, 1, window, 3, range(3))
        for position, shard in enumerate(shards.tolist()):
            assert any(first <= position <= last for first, last in uses[shard]), (window, position, shard)
