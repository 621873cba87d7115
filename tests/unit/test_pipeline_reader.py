"""The node's reader (pipeline/reader.py): NodeFuture knows every read of the node's shards, from each
rank of the node, padding included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vitforge.pipeline import DatasetIndex
from vitforge.pipeline.order import EpochOrder, RankSlice
from vitforge.pipeline.reader import NEVER, NodeFuture


def test_node_future_knows_every_read_of_the_node_padding_included():
    counts = np.array([17, 17, 3, 40, 0, 25, 9], np.int64)
    index = DatasetIndex([f"s3://b/{i}.tar" for i in range(len(counts))], counts, None)
    for window, world, per_node, consumed in ((1, 4, 2, 0), (5, 4, 2, 30), (64, 3, 3, 0), (5, 6, 2, 7)):
        loader_spec = SimpleNamespace(seed=2, shuffle_window=window)
        for rank in range(world):
            rank_slice = RankSlice(int(counts.sum()), consumed, rank, world, 8, "pad", 1, 4, per_node)
            future = NodeFuture(index, loader_spec, 1, rank_slice)
            order = EpochOrder(counts, 2, 1, window, 4, range(4))
            for r in rank_slice.node_ranks():
                mine = RankSlice(int(counts.sum()), consumed, r, world, 8, "pad", 1, 4, per_node)
                for b in range(mine.num_batches):
                    positions = mine.positions(b)
                    for position, shard in zip(positions.tolist(), order.at(positions)[0].tolist()):
                        assert future.next_use(shard, position) <= position < NEVER, (window, world, position)
