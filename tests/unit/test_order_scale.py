"""The epoch order made per partition, and the index loaded per shard (issue 18): the same samples
in the same order as one global sort of all N (loader state version 2), while a rank holds and
reads only its own partitions and their shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.cli import vitforge
from vitforge.pipeline import LoaderSpec, build_loader
from vitforge.pipeline.order import EpochOrder, RankSlice, mix, partition_starts, ranked_subset_ids, shard_uses


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


@pytest.fixture(scope="module")
def dataset(small_corpus, tmp_path_factory):
    """120 samples in 8 shards of 17 (the last of 1)."""
    out = tmp_path_factory.mktemp("order") / "shards"
    vitforge("shard", small_corpus, out, "--shard-samples", "17", "--workers", "2")
    return out


def spec(dataset, **kw):
    return LoaderSpec(str(dataset), **{"batch_size": 8, "image_size": 32, "workers": 0, "backend": "torch",
                                       "shuffle_window": 4, **kw})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_loads_only_the_index_of_its_shards_and_ranks_share_out_every_sample(dataset, world):
    loaders = [build_loader(spec(dataset, epoch_end="pad"), rank, world) for rank in range(world)]
    assert all(not loader.index.loaded for loader in loaders)  # nothing before the first epoch
    for epoch in range(2):
        per_rank = [[k for b in loader for k in b["key"]] for loader in loaders]
        assert len({len(keys) for keys in per_rank}) == 1
        assert {k for keys in per_rank for k in keys} == {f"{s}:{k}" for s, k in _keys(dataset)}
        for loader, keys in zip(loaders, per_rank):
            read = {k.split(":")[0] for k in keys}
            loaded = {loader.index.shard_urls[s].rsplit("/", 1)[1] for s in loader.index.loaded}
            assert loaded == read
    if world == 3:
        assert all(len(loader.index.loaded) < 8 for loader in loaders)


def _keys(dataset):
    manifest = json.loads((dataset / "dataset.json").read_text())
    for shard in manifest["shards"]:
        names = [line.split(" ")[3].split(".")[0] for line in (dataset / shard["index"]).read_text().splitlines()[1:]]
        yield from ((shard["name"], name) for name in names)


def test_a_version_2_run_with_a_subset_resumes_with_its_own_samples(dataset):
    everything = [f"{s}:{k}" for s, k in _keys(dataset)]
    old_subset = {everything[i] for i in ranked_subset_ids(120, 0.25, 0)}
    fresh = build_loader(spec(dataset, subset=0.25))
    new_subset = {k for b in fresh for k in b["key"]}
    assert len(new_subset) == len(old_subset) == 30 and new_subset != old_subset
    resumed = build_loader(spec(dataset, subset=0.25))
    resumed.load_state_dict({**fresh.state_dict(), "version": 2, "epoch": 1, "consumed": 8})
    assert len(resumed) == 3 and {k for b in resumed for k in b["key"]} <= old_subset
    resumed.load_state_dict({**fresh.state_dict(), "version": 2, "epoch": 2, "consumed": 0})
    assert {k for b in resumed for k in b["key"]} == old_subset


def test_a_run_resumed_with_a_version_2_subset_keeps_it_at_every_later_resume(dataset):
    everything = [f"{s}:{k}" for s, k in _keys(dataset)]
    old_subset = {everything[i] for i in ranked_subset_ids(120, 0.25, 0)}
    first = build_loader(spec(dataset, subset=0.25))
    first.load_state_dict({**first.state_dict(), "version": 2})
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["version"] == 3 and saved["ranked_subset"]
    again = build_loader(spec(dataset, subset=0.25))
    again.load_state_dict(saved)
    assert {k for b in again for k in b["key"]} == old_subset
    assert not build_loader(spec(dataset, subset=0.25)).state_dict()["ranked_subset"]


def test_node_future_knows_every_read_of_the_node_padding_included():
    from types import SimpleNamespace

    from vitforge.pipeline import DatasetIndex
    from vitforge.pipeline.reader import NEVER, NodeFuture

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


def test_a_bad_index_file_fails_when_the_loader_prepares_on_the_ranks_that_read_it(dataset, tmp_path, caplog):
    import pickle
    import shutil

    from vitforge.pipeline import DatasetError

    copy = tmp_path / "shards"
    shutil.copytree(dataset, copy)
    manifest = json.loads((copy / "dataset.json").read_text())
    bad = manifest["shards"][2]
    lines = (copy / bad["index"]).read_text().splitlines()
    (copy / bad["index"]).write_text("\n".join(lines[:-1]) + "\n")
    loaders = [build_loader(spec(copy), rank, 3) for rank in range(3)]  # reading no index file yet
    assert pickle.loads(pickle.dumps(loaders[0].index)).shard_urls == loaders[0].index.shard_urls
    failed = []
    for loader in loaders:
        try:
            loader.prepare()
        except DatasetError as e:
            failed.append(str(e))
    assert failed and len(failed) < 3
    assert all(f"{bad['index']}: lists {bad['samples'] - 1} samples, dataset.json says {bad['samples']}" in e
               for e in failed)
    with caplog.at_level("WARNING"):
        build_loader(spec(dataset, partitions=4), 0, 3)
    assert "each rank reads 4 of them" in caplog.text
