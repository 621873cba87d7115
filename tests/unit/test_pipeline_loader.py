"""The loader (pipeline/loader.py) with the index loaded per shard: a rank loads only the index of
the shards it reads and the ranks share out every sample, a bad index file fails on the ranks that
read it, and a run begun with a version-2 subset keeps its own samples at every resume."""

from __future__ import annotations

import json

import pytest
import torch

from common.cli import vitforge
from vitforge.pipeline import LoaderSpec, build_loader, choose_backend
from vitforge.pipeline.order import ranked_subset_ids


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


def test_synthetic_and_auto():
    loader = build_loader(LoaderSpec("unused", batch_size=4, image_size=16, backend="synthetic"),
                          synthetic_samples=20, synthetic_classes=7)
    batches = list(loader)
    assert len(batches) == 5 and batches[0]["image"].shape == (4, 3, 16, 16)
    assert batches[0]["label"].max() < 7
    assert choose_backend(LoaderSpec("x", batch_size=1), torch.device("cpu"))[0] == "dali-cpu"
