"""Augmentation and regularisation: crops and flips from the config, label smoothing, Mixup and
CutMix on the device batch, dropout; deterministic, exactly resumable, and enough to learn real
handwritten digits (scikit-learn's copy of the UCI set) that the default Inception crop cannot."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from common.checks import losses
from common.cli import train, train_args, vitforge
from vitforge.trainer.mixing import Mixing, cutmix_box, mix_batch, soft_targets


def test_soft_targets_smooth_and_ignore():
    targets = soft_targets(torch.tensor([2, -1, 0]), 4, 0.1)
    assert torch.allclose(targets[0], torch.tensor([0.025, 0.025, 0.925, 0.025]))
    assert torch.equal(targets[1], torch.zeros(4)) and targets[2].argmax() == 0
    assert torch.allclose(targets.sum(1), torch.tensor([1.0, 0.0, 1.0]))


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mixed_labels_sum_to_one_and_match_the_pixels(kind):
    images = torch.rand(6, 3, 16, 16)
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    mixing = Mixing(num_classes=6, seed=3, **{kind: 1.0})
    mixed, targets = mix_batch(images, labels, mixing, step=7, micro=0, rank=1)
    assert torch.allclose(targets.sum(1), torch.ones(6))
    lam = targets[0, 0].item()  # sample 0 keeps lam of its own class, takes 1 - lam of sample 5's
    assert 0 < lam < 1 and targets[0, 5].item() == pytest.approx(1 - lam)
    if kind == "mixup":
        assert torch.allclose(mixed, lam * images + (1 - lam) * images.flip(0))
    else:  # exactly the pasted share of the pixels comes from the partner
        from_partner = (mixed == images.flip(0)).all(dim=1) & (mixed != images).any(dim=1)
        assert from_partner[0].float().mean().item() == pytest.approx(1 - lam)
    again, same = mix_batch(images, labels, mixing, step=7, micro=0, rank=1)
    other, _ = mix_batch(images, labels, mixing, step=8, micro=0, rank=1)
    assert torch.equal(again, mixed) and torch.equal(same, targets) and not torch.equal(other, mixed)
    untouched = images.clone()
    mix_batch(images, labels, mixing, step=9, micro=1, rank=0)
    assert torch.equal(images, untouched)


def test_an_ignored_sample_adds_nothing_even_when_mixed_in():
    labels = torch.tensor([1, -1, 2, 0])
    _, targets = mix_batch(torch.rand(4, 3, 8, 8), labels, Mixing(3, 0, mixup=1.0), 0, 0, 0)
    lam = targets[0, 1].item()
    # sample 1 (ignored) pairs with sample 2: only sample 2's share remains
    assert targets[1].sum().item() == pytest.approx(1 - lam) and targets[1, 2].item() == pytest.approx(1 - lam)
    assert targets[2].sum().item() == pytest.approx(lam)


def test_cutmix_box_is_clipped_and_sized():
    rng = np.random.default_rng(0)
    for lam in (0.1, 0.5, 0.9):
        for _ in range(50):
            y0, y1, x0, x1 = cutmix_box(32, 24, lam, rng)
            assert 0 <= y0 <= y1 <= 32 and 0 <= x0 <= x1 <= 24
            assert (y1 - y0) * (x1 - x0) <= (1 - lam) * 32 * 24 + 1e-9


def test_bad_augment_values_are_named(data):
    for override, words in [("augment.crop_scale=[0.5,0.1]", "crop_scale"), ("augment.mixup=-1", "augment.mixup"),
                            ("augment.label_smoothing=1.5", "label_smoothing")]:
        result = vitforge("train", *train_args(data, "bad_aug", override), check=False)
        assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_training_with_every_regulariser_on_resumes_exactly(data, tmp_path):
    """Mixup, CutMix, label smoothing, RandAugment, dropout, stochastic depth, a narrower crop, no flip:
    a run stopped at step 6 and resumed logs the same losses as an uninterrupted one. (That each
    changes what is trained is tested where it is made: the mixing, RandAugment and crop tests.)"""
    common = ["train.steps=12", "train.log_every=1", "train.checkpoint_every=6", "data.val=null",
              "augment.mixup=0.8", "augment.cutmix=1.0", "augment.mix_prob=0.9", "augment.label_smoothing=0.1",
              "augment.crop_scale=[0.35,1.0]", "augment.flip=false", "augment.randaugment=[2,9]", "model.dropout=0.1",
              "model.drop_path=0.1",
              f"checkpoint.log_dir={tmp_path / 'straight'}"]
    train(data, "reg_straight", *common)
    resumed = [*common[:-1], f"checkpoint.log_dir={tmp_path / 'resumed'}"]
    train(data, "reg_resumed", *resumed, "train.stop_at=6")
    second = train(data, "reg_resumed", *resumed)
    assert "at step 6" in second.stderr
    straight, again = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(straight) == list(range(1, 13)) and again == straight


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """scikit-learn's 1,797 real 8x8 handwritten digits: the first 1,400 to train on, the other 397
    held out; written 4x larger (nearest neighbour) as PNGs, sharded."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    found = load_digits()
    for split, ids in (("train", range(1400)), ("val", range(1400, len(found.target)))):
        for i in ids:
            folder = root / f"{split}_src" / f"digit_{found.target[i]}"
            os.makedirs(folder, exist_ok=True)
            pixels = (found.images[i] * (255 / 16)).round().astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.Resampling.NEAREST).convert("RGB").save(
                folder / f"{i:04d}.png")
    vitforge("shard", root / "train_src", root / "train", "--workers", "2")
    vitforge("shard", root / "val_src", root / "val", "--prefix", "val", "--classes", root / "train" / "dataset.json",
             "--workers", "2")
    return root


@pytest.mark.slow(seconds=245)
def test_real_digits_reach_90_percent_with_a_narrower_crop_and_no_flip(digits):
    """A tiny ViT, 2 CPU processes, 3,000 steps of 64 (about 1.5 minutes here): crops of 35-100% of
    the area and no flip (a mirrored 2 is not a 2)."""
    run = digits / "runs" / "digits"
    result = train(digits, "digits", "train.steps=3000", "train.global_batch=64", "train.micro_batch=32",
                   "optimizer.lr=3e-3", "optimizer.warmup_steps=50", "train.eval_every=3000",
                   "train.checkpoint_every=null", "train.log_every=500", "augment.crop_scale=[0.35,1.0]",
                   "augment.flip=false", "data.backend=auto", "data.workers=1",
                   f"data.train={digits / 'train'}", f"data.val={digits / 'val'}", timeout=1500)
    final = json.loads(result.stdout.strip().splitlines()[-1])
    assert final["eval_samples"] == 397 and final["eval_top1"] >= 0.90, final
    assert run.exists()


@pytest.mark.slow
def test_a_tiny_hybrid_trains_and_exports(data, tmp_path):
    """The ResNet-stem hybrid through the same trainer, checkpoint and export as a plain ViT."""
    from safetensors.torch import load_file

    from vitforge.trainer import build_model

    logs = tmp_path / "logs"
    train(data, "hybrid", "model.name=vit_hybrid_tiny_cpu", "train.steps=6", "train.log_every=1",
          "train.checkpoint_every=6", "data.val=null", f"checkpoint.log_dir={logs}")
    trained = losses(logs)
    assert sorted(trained) == list(range(1, 7)) and all(np.isfinite(list(trained.values())))
    first = json.loads((logs / "metrics.jsonl").read_text().splitlines()[0])
    assert first["images_per_s"] > 0
    out = tmp_path / "hybrid.safetensors"
    vitforge("ckpt", "export", data / "runs" / "hybrid", "--out", out)
    model = build_model("vit_hybrid_tiny_cpu", 10, 32)
    model.load_state_dict(load_file(out), strict=True)
    assert any(k.startswith("patch_embed.backbone.stem") for k in load_file(out))


@pytest.mark.slow
def test_pre_training_with_the_paper_head_then_fine_tuning_with_a_zero_classifier(data):
    pre = train(data, "prelogits", "model.pre_logits=true", "train.steps=4", "train.checkpoint_every=4",
                "data.val=null")
    assert pre.returncode == 0
    tuned = train(data, "prelogits_ft", "train.steps=2", "data.val=null", "optimizer.name=sgd",
                  f"checkpoint.init_from={data / 'runs' / 'prelogits'}")
    assert "head.pre_logits.weight dropped (the pre-training head's representation layer)" in tuned.stderr
    assert "head.fc.weight dropped" in tuned.stderr and "head.weight (10, 64) zero-initialised" in tuned.stderr
