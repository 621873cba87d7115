"""Our shards read cleanly with tools nobody here wrote: GNU tar, webdataset, DALI's wds2idx and reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from common.cli import vitforge
from vitforge.shards import index_tar
from test_zoo import AS_UNPRIVILEGED
from common.zoo import write_zoo


@pytest.fixture(scope="module")
def sharded(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "out"
    vitforge("shard", small_corpus, out, "--shard-samples", "32", "--workers", "2")
    return out, json.loads((out / "dataset.json").read_text())


@pytest.fixture(scope="module")
def sharded_zoo(tmp_path_factory):
    """The zoo's survivors: PNGs and re-encoded JPEGs beside kept ones."""
    root = tmp_path_factory.mktemp("zoo")
    write_zoo(root / "src")
    out = root / "out"
    vitforge("shard", root / "src", out, "--min-side", "8", "--workers", "1", prefix=AS_UNPRIVILEGED)
    os.chmod(root / "src" / "zoo" / "unreadable.jpg", 0o644)
    return out, json.loads((out / "dataset.json").read_text())


def test_gnu_tar_lists_every_member_without_warnings(sharded):
    out, manifest = sharded
    for shard in manifest["shards"]:
        result = subprocess.run(["tar", "-tvf", out / shard["name"]], capture_output=True, text=True)
        assert result.returncode == 0 and result.stderr == ""
        lines = result.stdout.splitlines()
        assert len(lines) == 3 * shard["samples"]
        assert all(line.startswith("-rw-r--r--") for line in lines)
    extract = out.parent / "extracted"
    extract.mkdir()
    result = subprocess.run(["tar", "-xf", out / manifest["shards"][0]["name"], "-C", extract],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""


@pytest.mark.parametrize("which", ["sharded", "sharded_zoo"])
def test_index_equals_dali_wds2idx(which, request, tmp_path):
    out, manifest = request.getfixturevalue(which)
    wds2idx = shutil.which("wds2idx", path=os.path.dirname(sys.executable))
    assert wds2idx, "wds2idx comes with the DALI wheel (extra 'dali')"
    for shard in manifest["shards"]:
        theirs = tmp_path / shard["index"]
        subprocess.run([wds2idx, out / shard["name"], theirs], check=True, capture_output=True)
        assert (out / shard["index"]).read_bytes() == theirs.read_bytes()
        assert index_tar(str(out / shard["name"])) == theirs.read_bytes()  # what the loader scans foreign tars with


def test_webdataset_reads_every_sample_with_label_and_bytes(sharded, small_corpus):
    import webdataset as wds

    out, manifest = sharded
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    seen = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        info = json.loads(sample["json"])
        assert int(sample["cls"]) == info["label"]
        source = small_corpus / info["source"].split("/images/", 1)[1]
        assert sample["jpg"] == source.read_bytes()
        assert manifest["classes"][info["label"]] == source.parent.name
        seen[sample["__key__"]] = info["label"]
    assert len(seen) == manifest["totals"]["samples"] == 120


def _dali_read(out, manifest, exts):
    from nvidia.dali import fn, pipeline_def, types

    paths = [str(out / s["name"]) for s in manifest["shards"]]
    indexes = [str(out / s["index"]) for s in manifest["shards"]]

    @pipeline_def(batch_size=8, num_threads=2, device_id=None)
    def pipe():
        image, label = fn.readers.webdataset(paths=paths, index_paths=indexes, ext=[exts, "cls"],
                                             missing_component_behavior="error", pad_last_batch=True,
                                             name="reader")
        return fn.decoders.image(image, device="cpu", output_type=types.RGB), label

    p = pipe()
    p.build()
    total = p.epoch_size("reader")
    labels, shapes = [], []
    for _ in range(-(-total // 8)):
        images, cls = p.run()
        for i in range(len(cls)):
            labels.append(int(bytes(np.array(cls.at(i))).decode()))
            shapes.append(np.array(images.at(i)).shape)
    return total, labels[:total], shapes[:total]


def test_dali_cpu_pipeline_reads_the_shards(sharded):
    out, manifest = sharded
    total, labels, shapes = _dali_read(out, manifest, "jpg")
    assert total == 120
    assert np.bincount(labels).tolist() == manifest["class_counts"]
    assert all(len(s) == 3 and s[2] == 3 for s in shapes)


def test_dali_decodes_every_normalised_zoo_survivor(sharded_zoo):
    out, manifest = sharded_zoo
    total, labels, shapes = _dali_read(out, manifest, "jpg;png;webp")
    assert total == manifest["totals"]["samples"] > 5
    assert all(s[2] == 3 for s in shapes)
