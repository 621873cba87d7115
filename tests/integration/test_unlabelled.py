"""Datasets without class labels (for masked patch prediction): sharded with --no-labels from a
folder of images at any depth or a manifest with only a path column, verified, and loaded by both
backends; classification refuses them. Pre-training on one is in test_masked_patches."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from common.checks import dataset_samples
from common.cli import EXTENSIONS, train_args, vitforge
from vitforge.pipeline import IGNORE_LABEL, LoaderSpec, build_loader
from vitforge.synthetic import class_image, jpeg_bytes


@pytest.fixture(scope="module")
def corpora(small_corpus, tmp_path_factory):
    """The same 120 images sharded with labels and without, plus a loose folder at several depths."""
    root = tmp_path_factory.mktemp("unlabelled")
    vitforge("shard", small_corpus, root / "labelled", "--shard-samples", "16", "--workers", "2")
    vitforge("shard", small_corpus, root / "unlabelled", "--shard-samples", "16", "--workers", "2", "--no-labels")
    return root


def test_shards_carry_no_labels_and_the_same_images_in_the_same_order(corpora):
    manifest = json.loads((corpora / "unlabelled" / "dataset.json").read_text())
    assert manifest["num_classes"] is None and manifest["classes"] == [] and manifest["class_counts"] == []
    assert "--no-labels" in manifest["command"] and "--label-column" not in manifest["command"]
    plain, labelled = dataset_samples(corpora / "unlabelled"), dataset_samples(corpora / "labelled")
    assert [s["key"] for s in plain] == [s["key"] for s in labelled]  # the order depends on names only
    assert [s["image_bytes"] for s in plain] == [s["image_bytes"] for s in labelled]
    assert all(s["cls"] is None and "label" not in s["info"] and "class" not in s["info"] for s in plain)
    index_lines = (corpora / "unlabelled" / "train-000000.idx").read_text().splitlines()[1:]
    entries = [line.split(" ")[::4] for line in index_lines]
    assert entries == [["jpg", "json"]] * 16
    checked = vitforge("shard", "verify", corpora / "unlabelled")
    assert "verified 8 shards, 120 samples: all good" in checked.stdout
    assert "classes      none (unlabelled)" in vitforge("shard", "info", corpora / "unlabelled").stdout


def test_a_loose_folder_and_a_path_only_manifest_shard_every_image(tmp_path):
    images = {"top.jpg": 0, "a/one.jpg": 1, "a/b/c/deep.png": 2, "z/two.jpeg": 3}
    for rel, i in images.items():
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = class_image(i, 10, np.random.default_rng(i), (40, 30), 0.1)
        if rel.endswith(".png"):
            Image.fromarray(pixels).save(path)
        else:
            path.write_bytes(jpeg_bytes(pixels))
    (tmp_path / "src" / "a" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    (tmp_path / "src" / "notes.txt").write_text("not an image")
    folder = vitforge("shard", tmp_path / "src", tmp_path / "out", "--no-labels", "--workers", "1")
    assert "5 inputs = 4 packed + 1 rejected" in folder.stdout and "unlabelled" in folder.stdout
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["source"].endswith("a/broken.jpg") for r in rejects] == [True]
    sources = sorted(s["info"]["source"].split("src/", 1)[1] for s in dataset_samples(tmp_path / "out"))
    assert sources == sorted(images)
    # A manifest needs no label column; its other columns travel as metadata.
    rows = [{"path": rel, "caption": f"image {i}"} for rel, i in images.items()]
    (tmp_path / "src" / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    listed = vitforge("shard", tmp_path / "src" / "list.jsonl", tmp_path / "listed", "--no-labels", "--workers", "1")
    assert "4 inputs = 4 packed + 0 rejected" in listed.stdout
    metas = sorted(s["info"]["meta"]["caption"] for s in dataset_samples(tmp_path / "listed"))
    assert metas == [f"image {i}" for i in range(4)]
    # Without --no-labels the same manifest is refused for its missing label column.
    refused = vitforge("shard", tmp_path / "src" / "list.jsonl", tmp_path / "refused", check=False)
    assert refused.returncode == 2 and "no column 'label'" in refused.stderr
    clash = vitforge("shard", tmp_path / "src", tmp_path / "clash", "--no-labels", "--classes",
                     tmp_path / "src" / "notes.txt", check=False)
    assert clash.returncode == 2 and "--classes and --no-labels contradict" in clash.stderr


def test_verify_names_a_label_inside_an_unlabelled_dataset(corpora, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(corpora / "unlabelled", out)
    shard = out / "train-000003.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    key = members[0][0].name.split(".", 1)[0]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members[:1] + [(tarfile.TarInfo(f"{key}.cls"), b"3")] + members[1:]:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    checked = vitforge("shard", "verify", out, check=False)
    assert checked.returncode != 0
    assert f"train-000003.tar: sample {key}: has a .cls label '3' but the dataset is unlabelled" in checked.stdout


@pytest.mark.parametrize("backend", ["torch", "dali-cpu"])
def test_loaders_deliver_the_images_with_no_labels_and_mark_padding_unreal(corpora, backend):
    def epoch(name: str, train: bool) -> list[dict]:
        spec = LoaderSpec(str(corpora / name), batch_size=16, image_size=32, train=train, backend=backend,
                          workers=0 if backend == "torch" else 1)
        return list(build_loader(spec, rank=0, world_size=3))

    for train in (True, False):
        plain, labelled = epoch("unlabelled", train), epoch("labelled", train)
        assert len(plain) == len(labelled)
        for a, b in zip(plain, labelled):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
            assert bool((a["label"] == IGNORE_LABEL).all()) and not a["bad"]
            assert torch.equal(a["real"], b["real"]) and torch.equal(b["real"], b["label"] != IGNORE_LABEL)
    # 120 samples over 3 ranks of 16: eval pads the last batch; padding is not real.
    padded = epoch("unlabelled", False)
    assert sum(int(b["real"].sum()) for b in padded) == 40 and not bool(padded[-1]["real"].all())


def test_tars_made_elsewhere_without_labels_load_and_mixed_ones_are_refused(corpora, tmp_path):
    for shard in ("train-000000", "train-000001"):
        shutil.copy(corpora / "unlabelled" / f"{shard}.tar", tmp_path / f"{shard}.tar")
    loader = build_loader(LoaderSpec(str(tmp_path / "train-*.tar"), batch_size=8, image_size=32, backend="torch",
                                     workers=0))
    assert not loader.index.labelled and len(loader.index) == 32
    assert all(bool((b["label"] == IGNORE_LABEL).all()) for b in loader)
    shutil.copy(corpora / "labelled" / "train-000002.tar", tmp_path / "a-000000.tar")
    shutil.copy(corpora / "unlabelled" / "train-000002.tar", tmp_path / "a-000001.tar")
    with pytest.raises(Exception, match=r"a-000001.tar: sample \d+ has no .cls label member"):
        build_loader(LoaderSpec(str(tmp_path / "a-*.tar"), batch_size=8, image_size=32, backend="torch", workers=0))


@pytest.mark.slow
def test_classification_refuses_unlabelled_data_naming_it(corpora):
    args = train_args(corpora, "refused", f"data.train={corpora / 'unlabelled'}", f"data.val={corpora / 'labelled'}")
    result = vitforge("train", *args, env=EXTENSIONS, check=False)
    assert result.returncode == 2
    assert f"{corpora / 'unlabelled'} has no class labels (sharded with --no-labels)" in result.stderr
    assert "train.objective=masked_patch_prediction" in result.stderr
