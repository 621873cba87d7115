"""Training on a mixture (pipeline/mixture.py): 3 sources at 0.6/0.3/0.1 hold their weights in
every window of every rank on both backends, each source read in its own loader's order; a resume
(same or another world size) goes on with every source exactly; bad mixtures are one line naming
the source; a mixture of an s3:// and a local source trains 2 ranks and evaluates; a mixture run
killed -9 or requeued by SIGUSR1 resumes to the uninterrupted run's losses."""

from __future__ import annotations

import json
import shutil
import signal
import tarfile
import time

import numpy as np
import pytest

from common.checks import losses
from common.cli import EXTENSIONS, start_ranks, train, vitforge
from vitforge.core import CheckpointError, errors
from vitforge.pipeline import DatasetError, LoaderSpec, MixtureSource, batch_counts, build_loader, build_mixture_loader
from vitforge.pipeline.loader import dataset_index, node_shards
from vitforge.pipeline.mixture import SOURCE_SHIFT, interleave
from vitforge.shards import ShardJob, run
from vitforge.synthetic import write_class_folders

WEIGHTS = (0.6, 0.3, 0.1)
SAMPLES = 5000
BATCH = 16
BOUND = 4  # the stated bound: every window of k samples holds weight x k of each source within 4


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three datasets of 3,000, 1,500 and 500 16 px images (3, 2 and 2 classes)."""
    root = tmp_path_factory.mktemp("mixture")
    urls = []
    for name, classes, per_class in (("a", 3, 1000), ("b", 2, 750), ("c", 2, 250)):
        write_class_folders(str(root / f"{name}-src"), num_classes=classes, per_class=per_class, size=(16, 16),
                            seed=ord(name))
        run(ShardJob(str(root / f"{name}-src"), str(root / name), prefix=name, shard_samples=250, shard_bytes=None,
                     workers=2))
        urls.append(str(root / name))
    return urls


def _mixture(urls, weights=WEIGHTS):
    return [MixtureSource(url=u, weight=w) for u, w in zip(urls, weights)]


def _loaders(urls, world_size, backend="torch", workers=0, weights=WEIGHTS, **settings):
    spec = LoaderSpec(urls[0], batch_size=BATCH, image_size=16, backend=backend, workers=workers, seed=3, **settings)
    return [build_mixture_loader(spec, _mixture(urls, weights), rank, world_size) for rank in range(world_size)]


def _take(loader, batches: int) -> list[tuple[int, int, int, str]]:
    """(source, position in its source's epoch, label, key) of each sample of the next `batches`."""
    out = []
    while len(out) < batches * BATCH:
        for batch in loader:
            out += [(int(p) >> SOURCE_SHIFT, int(p) & ((1 << SOURCE_SHIFT) - 1), int(label), key)
                    for p, label, key in zip(batch["position"], batch["label"].tolist(), batch["key"])]
            if len(out) >= batches * BATCH:
                break
    return out


def _worst_window(sources: np.ndarray, weights) -> float:
    share = np.asarray(weights) / sum(weights)
    worst = 0.0
    for s, w in enumerate(share):
        counts = np.concatenate([[0], np.cumsum(sources == s)])
        for k in range(1, len(sources) + 1):
            worst = max(worst, float(np.abs(counts[k:] - counts[:-k] - w * k).max()))
    return worst


def test_the_schedule_holds_any_weights_within_the_bound_in_every_window():
    """The counts alone, for WEIGHTS (0.6/0.3/0.1) over 5,000 samples and 40 other mixtures, world
    sizes and batch sizes (the worst seen: 3.5, with 5 sources at 16 ranks x 128)."""
    rng = np.random.default_rng(0)
    cases = [(WEIGHTS, 1, BATCH, SAMPLES), (WEIGHTS, 2, BATCH, SAMPLES)]
    cases += [(tuple(rng.random(rng.integers(2, 6)) ** 2 + 0.005), int(rng.integers(1, 64)), int(rng.integers(6, 128)),
               800) for _ in range(40)]
    for weights, world_size, batch, samples in cases:
        taken, seen = [0] * len(weights), []
        while len(seen) < samples:
            counts = batch_counts(weights, taken, world_size, batch)
            assert sum(counts) == batch and min(counts) >= 0
            seen += np.repeat(np.arange(len(counts)), counts)[interleave(counts)].tolist()
            taken = [t + c * world_size for t, c in zip(taken, counts)]
        assert _worst_window(np.asarray(seen[:samples]), weights) < BOUND, (weights, world_size, batch)


@pytest.mark.parametrize("backend", ["torch", "dali-cpu"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_three_sources_hold_their_weights_in_every_window_in_their_own_order(sources, backend, workers, world_size):
    loaders = _loaders(sources, world_size, backend, workers)
    for rank, loader in enumerate(loaders):
        seen = _take(loader, SAMPLES // world_size // BATCH)
        picked = np.asarray([s for s, _, _, _ in seen])
        assert _worst_window(picked, WEIGHTS) < BOUND
        for s, first_label, classes in ((0, 0, 3), (1, 3, 2), (2, 5, 2)):
            mine = [(position, label, key) for source, position, label, key in seen if source == s]
            # Each source in its loader's order: positions rank, rank + W, ... of its epoch, then again.
            positions = [p for p, _, _ in mine]
            restarts = [i for i in range(1, len(positions)) if positions[i] < positions[i - 1]]
            for start, stop in zip([0, *restarts], [*restarts, len(positions)]):
                assert positions[start:stop] == list(range(rank, rank + world_size * (stop - start), world_size))
            # Offset labels: each source's ids after the previous sources'; keys name the source.
            assert {label for _, label, _ in mine} == set(range(first_label, first_label + classes))
            assert all(key.startswith(f"{s}/{'abc'[s]}-") for _, _, key in mine)
    assert loaders[0].index.num_classes == 7


@pytest.mark.parametrize("after", [1, 2, 3], ids=lambda w: f"resumed-at-{w}-ranks")
def test_a_resume_goes_on_with_every_source_exactly(sources, after):
    """2 ranks take 37 batches (no source at a multiple of a batch), the state is saved, then the
    run goes on at 1, 2 or 3 ranks past every source's epoch end: each source's samples after the
    save are the uninterrupted run's, in its order (positions below its size: the repeats that even
    out an epoch's last row of ranks depend on the world size)."""
    sizes = (3000, 1500, 500)

    def per_source(runs) -> list[list[tuple[int, int, str]]]:
        # every rank's samples of each source, in the source's global order (epoch, position)
        out = [[] for _ in WEIGHTS]
        for seen in runs:
            epoch, last = [0, 0, 0], [-1, -1, -1]
            for s, position, _, key in seen:
                epoch[s] += position < last[s]
                last[s] = position
                if position < sizes[s]:
                    out[s].append((epoch[s], position, key))
        return [sorted(o) for o in out]

    straight = _loaders(sources, 2)
    for loader in straight:
        _take(loader, 37)
    state = straight[0].state_dict()
    assert state == straight[1].state_dict()
    assert any(c % (2 * BATCH) for c in (source["consumed"] for source in state["sources"]))
    uninterrupted = per_source([_take(loader, 220) for loader in straight])
    resumed = _loaders(sources, after)
    for loader in resumed:
        loader.load_state_dict(json.loads(json.dumps(state)))
    again = per_source([_take(loader, 440 // after) for loader in resumed])
    for s in range(len(WEIGHTS)):
        assert {epoch for epoch, _, _ in uninterrupted[s]} == {0, 1}  # past the source's epoch end
        n = min(len(uninterrupted[s]), len(again[s]))
        assert n > 300
        assert [k for _, _, k in again[s][:n]] == [k for _, _, k in uninterrupted[s][:n]]


def test_other_weights_are_refused_on_resume_unless_reweighted_and_then_held_from_there(sources):
    loader = _loaders(sources, 1, weights=(0.9, 0.05, 0.05))[0]
    _take(loader, 60)
    state = loader.state_dict()
    with pytest.raises(CheckpointError, match=r"set data.reweight=true"):
        _loaders(sources, 1, weights=(0.2, 0.4, 0.4))[0].load_state_dict(state)
    _loaders(sources, 1, weights=(1.8, 0.1, 0.1))[0].load_state_dict(state)  # the same mixture, other units
    reweighted = _loaders(sources, 1, weights=(0.2, 0.4, 0.4), reweight=True)[0]
    reweighted.load_state_dict(state)
    assert [ld.consumed for ld in reweighted.loaders] == [ld.consumed for ld in loader.loaders]
    # the new weights hold from the first batch after the resume, not once the old ones are paid back
    picked = np.asarray([s for s, _, _, _ in _take(reweighted, 40)])
    assert _worst_window(picked, (0.2, 0.4, 0.4)) < BOUND


def test_by_name_maps_each_source_by_its_names_and_refuses_a_held_out_set_in_another_order(sources, tmp_path):
    """Source x holds class_01 and class_02 (its ids 0, 1), source b class_00 and class_01: by name,
    in the order first seen, class_01 -> 0, class_02 -> 1, class_00 -> 2."""
    write_class_folders(str(tmp_path / "x-src"), num_classes=3, per_class=40, size=(16, 16), seed=5)
    shutil.rmtree(tmp_path / "x-src" / "class_00")
    run(ShardJob(str(tmp_path / "x-src"), str(tmp_path / "x"), prefix="x", shard_samples=40, shard_bytes=None))
    loader = _loaders([str(tmp_path / "x"), sources[1]], 1, weights=(1, 1), label_space="by_name")[0]
    assert loader.index.classes == ["class_01", "class_02", "class_00"] and loader.index.num_classes == 3
    datasets = [str(tmp_path / "x"), sources[1]]
    for s, _, label, key in _take(loader, 20):
        assert loader.index.classes[label] == json.loads(_sample_json(datasets[s], key))["class"]
    loader.index.check_eval(["class_01", "class_02", "class_00"], "val")
    with pytest.raises(DatasetError, match=r"data.val val: its class 0 is 'class_00', the mixture's is 'class_01'"):
        loader.index.check_eval(["class_00", "class_01", "class_02"], "val")
    offset = _loaders(sources, 1)[0]
    offset.index.check_eval(["class_00", "class_01", "class_02"], "val")  # the first source's classes
    with pytest.raises(DatasetError, match="data.label_space=offset"):
        offset.index.check_eval(["class_01"], "val")


def _sample_json(dataset: str, key: str) -> bytes:
    """The .json member of sample `key` ("S/SHARD.tar:KEY") of `dataset`."""
    shard, sample = key.split("/", 1)[1].split(":")
    with tarfile.open(f"{dataset}/{shard}") as tar:
        return tar.extractfile(f"{sample}.json").read()


def test_the_decode_workers_are_shared_out_and_a_mixture_below_one_step_is_refused(sources):
    def workers(n: int) -> list[int]:
        spec = LoaderSpec(sources[0], batch_size=BATCH, image_size=16, backend="torch", workers=n)
        return [ld.spec.workers for ld in build_mixture_loader(spec, _mixture(sources)).loaders]

    # one each (a source decoding in the training process takes the step's thread), the rest by weight
    assert workers(0) == [0, 0, 0] and workers(2) == [1, 1, 1] and workers(8) == [4, 3, 1]
    big = LoaderSpec(sources[0], batch_size=2000, image_size=16, backend="torch", workers=0)
    with pytest.raises(DatasetError, match=r"the mixture's 5000 samples are fewer than one optimizer step of 4 ranks "
                                           r"x 2000 x 1"):
        build_mixture_loader(big, _mixture(sources), 0, 4)


@pytest.mark.parametrize("world_size", [4, 7])
def test_the_shards_a_node_is_counted_on_are_those_its_ranks_read_in_an_epoch(sources, world_size):
    """A source's cache share is sized from node_shards: every shard the node's ranks open in an
    epoch, the last batch's padding included (at 7 ranks of 16, 3,000 samples leave 24 positions
    of padding, which open 1 to 4 more shards on each node), exactly when the order mixes no
    samples across shards (shuffle_window 1); with a window, a superset of them, not every shard."""
    for window in (1, 16384):
        spec = LoaderSpec(sources[0], batch_size=BATCH, image_size=16, backend="torch", workers=0, seed=3,
                          shuffle_window=window)
        index = dataset_index(spec)
        names = [url.rsplit("/", 1)[-1] for url in index.shard_urls]
        for node in range(-(-world_size // 2)):
            ranks = range(2 * node, min(2 * node + 2, world_size))
            read = {key.split(":")[0] for rank in ranks
                    for batch in build_loader(spec, rank, world_size, ranks_per_node=2) for key in batch["key"]}
            counted = {names[s] for s in node_shards(index, spec, ranks[0], world_size, 2)}
            assert (counted == read if window == 1 else read <= counted), (window, node, sorted(counted ^ read))
            assert len(counted) < len(names)


@pytest.mark.parametrize("mixture, words", [
    ("[{url: A, weight: 0}]", ["data.train", "source A has weight 0.0: a weight must be a number > 0"]),
    ("[{url: B, weight: 1}, {url: A, weight: -1}]", ["data.train", "source A has weight -1.0"]),
    ("[{url: A, weight: .nan}]", ["data.train", "source A has weight nan"]),
    ("[]", ["a mixture needs at least one source"]),
    ("[{url: A, weight: 1}, {url: A, weight: 2}]", ["a source is listed twice", "A"]),
    ("[{url: A, weight: 1}, {url: MISSING, weight: 1}]", ["mixture source MISSING"]),
], ids=["zero", "negative", "nan", "empty", "twice", "missing"])
def test_a_bad_mixture_is_exit_2_naming_the_source(sources, tmp_path, mixture, words):
    mixture = mixture.replace("MISSING", str(tmp_path / "nothing-here")).replace("A", sources[0]).replace("B", sources[1])
    words = [w.replace("MISSING", str(tmp_path / "nothing-here")).replace("A", sources[0]) for w in words]
    result = vitforge("train", "tiny_cpu", "--set", f"data.train={mixture}", "--set", "data.val=null",
                      "--set", f"checkpoint.dir={tmp_path}", "--set", "data.backend=torch", env=EXTENSIONS,
                      check=False)
    assert result.returncode == 2, result.stderr
    assert all(w in result.stderr for w in words), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_mixture_of_an_s3_and_a_local_source_trains_2_ranks_and_evaluates(data, s3_server, s3_env, bucket, tmp_path):
    client = s3_server["client"]
    for path in sorted((data / "train").iterdir()):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"train/{path.name}", Body=path.read_bytes())
    # One node cache bound: the S3 source gets what a node reads of it (all of it fits in 2 GB), the
    # local source, read in place, none.
    spec = LoaderSpec(f"s3://{bucket}/train", batch_size=8, image_size=16, backend="torch", cache_gb=2.0,
                      cache_dir=str(tmp_path / "cache"))
    shares = build_mixture_loader(spec, [MixtureSource(url=f"s3://{bucket}/train", weight=1),
                                         MixtureSource(url=str(data / "train"), weight=3)]).loaders
    stored = sum(s["bytes"] for s in json.loads((data / "train" / "dataset.json").read_text())["shards"])
    assert [ld.spec.cache_gb * 1e9 for ld in shares] == [pytest.approx(stored), 0]
    mixture = f"[{{url: s3://{bucket}/train, weight: 3}}, {{url: {data / 'train'}, weight: 1}}]"
    logs = tmp_path / "logs"
    result = train(data, "mixed", f"data.train={mixture}", "data.label_space=by_name", "train.steps=8",
                   "train.eval_every=8", "train.log_every=4", f"checkpoint.log_dir={logs}",
                   f"data.cache_dir={tmp_path / 'cache'}", store=str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "source_0_samples_seen" in r][-1]
    # 8 steps of 32: 3/4 from S3, 1/4 local, within the bound on each of the 2 ranks
    assert last["source_0_samples_seen"] + last["source_1_samples_seen"] == 8 * 32
    assert abs(last["source_0_samples_seen"] - 0.75 * 256) <= 2 * BOUND
    assert 0 <= last["source_0_data_wait_fraction"] <= 1
    # by name, both sources' classes are the held-out set's ten: the evaluation is well above chance (0.1)
    assert [r for r in rows if "eval_top1" in r][-1]["eval_top1"] >= 0.3, rows[-1]


@pytest.mark.slow(seconds=30)
def test_a_mixture_run_killed_or_requeued_resumes_to_the_uninterrupted_run(data, tmp_path):
    """kill -9 of every rank mid-run, and SIGUSR1 to one rank (the requeue), each resumed: the
    losses of every step, and each source's samples seen, equal the uninterrupted run's."""
    store = tmp_path / "runs"
    mixture = f"[{{url: {data / 'train'}, weight: 0.7}}, {{url: {data / 'val'}, weight: 0.3}}]"
    settings = (f"data.train={mixture}", "train.steps=12", "train.log_every=1", "train.checkpoint_every=4",
                "data.val=null", "checkpoint.keep_last=10")

    def seen(run: str) -> list[int]:
        rows = [json.loads(line) for line in (store / run / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if "source_0_samples_seen" in r][-1]
        return [last["source_0_samples_seen"], last["source_1_samples_seen"]]

    def logged(run: str, step: int) -> bool:
        path = store / run / "metrics.jsonl"
        return path.exists() and any(json.loads(line).get("step", 0) >= step for line in path.read_text().splitlines())

    train(data, "straight", *settings, store=str(store))
    killed = start_ranks(data, "killed", *settings, store=str(store))
    deadline = time.monotonic() + 240
    # mid-run, once a checkpoint is complete (saves finish behind the steps)
    while (not (logged("killed", 6) and (store / "killed" / "latest").exists()) and time.monotonic() < deadline
           and all(r.poll() is None for r in killed)):
        time.sleep(0.05)
    assert all(r.poll() is None for r in killed), "the run ended before it could be killed"
    for rank in killed:
        rank.kill()
        rank.communicate()
    latest = int((store / "killed" / "latest").read_text().removeprefix("step_"))
    assert latest in (4, 8)
    assert f"at step {latest}" in train(data, "killed", *settings, store=str(store)).stderr

    requeued = start_ranks(data, "requeued", *settings, store=str(store))
    while not logged("requeued", 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    requeued[1].send_signal(signal.SIGUSR1)
    outputs = [r.communicate(timeout=240) for r in requeued]
    assert [r.returncode for r in requeued] == [errors.REQUEUE, errors.REQUEUE], outputs[0][1][-3000:]
    step = int(outputs[0][1].split("stopped at step ")[1].split()[0])
    assert 2 <= step < 12
    assert f"at step {step}" in train(data, "requeued", *settings, store=str(store)).stderr

    for name in ("killed", "requeued"):
        assert losses(store / name) == losses(store / "straight"), name
        assert seen(name) == seen("straight"), name
    assert sum(seen("straight")) == 12 * 32 and abs(seen("straight")[0] - 0.7 * 12 * 32) <= 2 * BOUND
