"""Masked patch prediction: the corruption's proportions and determinism, colour targets against a
hand computation, pre-training that learns, and fine-tuning that starts from the pre-trained encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.checks import losses
from common.cli import train, vitforge
from vitforge.trainer.masked_patches import KEPT, MASKED, SWAPPED, UNTOUCHED, colour_targets, corruption


def test_half_the_patches_are_corrupted_80_10_10_deterministically():
    positions = np.arange(4000)
    action, source = corruption(seed=3, epoch=1, positions=positions, patches=196)
    assert ((action != UNTOUCHED).sum(axis=1) == 98).all()  # exactly half of every image
    corrupted = action[action != UNTOUCHED]
    shares = [np.mean(corrupted == kind) for kind in (MASKED, SWAPPED, KEPT)]
    assert shares == pytest.approx([0.8, 0.1, 0.1], abs=0.005)  # 392,000 corrupted patches
    patch = np.arange(196)
    assert (source[action == SWAPPED] != np.broadcast_to(patch, action.shape)[action == SWAPPED]).all()
    assert (source[action != SWAPPED] == np.broadcast_to(patch, action.shape)[action != SWAPPED]).all()
    again, same = corruption(3, 1, positions[:10], 196)
    assert np.array_equal(again, action[:10]) and np.array_equal(same, source[:10])
    assert not np.array_equal(corruption(3, 2, positions[:10], 196)[0], action[:10])  # another epoch
    assert not np.array_equal(corruption(4, 1, positions[:10], 196)[0], action[:10])  # another seed


def test_colour_targets_equal_a_hand_computation():
    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 8, 12, generator=generator)
    targets = colour_targets(pixels, (2, 3))
    for b in range(2):
        for r in range(2):
            for c in range(3):
                mean = pixels[b, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4].mean(dim=(1, 2))
                red, green, blue = (min(int(v * 8), 7) for v in mean.tolist())
                assert targets[b, r * 3 + c].item() == red * 64 + green * 8 + blue
    white, black = torch.ones(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)
    assert colour_targets(white, (1, 1)).item() == 511 and colour_targets(black, (1, 1)).item() == 0


def test_the_model_sees_the_mask_embedding_and_swapped_patches():
    from vitforge.trainer import build_model

    model = build_model("vit_tiny_cpu", 10, 32, objective="masked_patch_prediction").eval()
    images = torch.randn(2, 3, 32, 32)
    plain = torch.zeros(2, 16, dtype=torch.long)
    identity = torch.arange(16).expand(2, 16)
    out = model(images, plain, identity)
    assert out.shape == (2, 16, 512)
    masked = plain.clone()
    masked[0, 3] = MASKED
    assert not torch.allclose(model(images, masked, identity)[0], out[0])
    assert torch.allclose(model(images, masked, identity)[1], out[1])
    kept = plain.clone()
    kept[0, 3] = KEPT  # corrupted but left as it was: the same input
    assert torch.equal(model(images, kept, identity), out)


@pytest.mark.slow
def test_pre_training_learns_colours_and_fine_tuning_starts_from_its_encoder(data, tmp_path):
    from safetensors.torch import load_file

    from vitforge.trainer import adapt_state_dict, build_model

    # Pre-training needs no labels: the same images, sharded without them.
    for split in ("train", "val"):
        vitforge("shard", data / f"{split}_src", tmp_path / split, "--no-labels", "--shard-samples", "64",
                 "--workers", "2")
    logs = tmp_path / "mpp"
    # The few-shot probe reads the encoder's features (issue 22): no head, and no labels in the training
    # data; the probe dataset brings its own.
    probe = f"eval.probes={{digits: {{train: {data / 'train'}, test: {data / 'val'}}}}}"
    train(data, "mpp", "train.objective=masked_patch_prediction", "train.steps=60", "train.log_every=10",
          "train.eval_every=60", "train.checkpoint_every=60", "augment.flip=false", f"checkpoint.log_dir={logs}",
          f"data.train={tmp_path / 'train'}", f"data.val={tmp_path / 'val'}", probe, "eval.fewshot=[5]")
    history = losses(logs)
    assert history[60] < 0.7 * history[10], history  # predicting colours is learnable
    final = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["eval_patches"] == 100 * 8 and final["eval_colour_top1"] > 1 / 512 * 20
    assert final["eval_fewshot_digits_5shot"] > 0.3, final  # chance: 0.1
    figures = json.loads(vitforge("inspect", data / "runs" / "mpp", "--images", tmp_path / "val", "--count", "4",
                                  "--out", tmp_path / "figures").stdout.strip().splitlines()[-1])
    assert figures["grid"] == [4, 4] and len(figures["mean_attention_distance_per_layer"]) == 2
    # The fine-tuning start: the encoder's weights exactly (the export is the encoder, under timm's
    # names), a zero-initialised classifier.
    vitforge("ckpt", "export", data / "runs" / "mpp", "--out", tmp_path / "mpp.safetensors")
    pretrained = load_file(tmp_path / "mpp.safetensors")
    classifier = build_model("vit_tiny_cpu", 10, 32)
    state, changed = adapt_state_dict(pretrained, classifier)
    assert "head.weight (10, 64) zero-initialised for 10 classes" in changed
    classifier.load_state_dict(state, strict=True)
    for name, value in classifier.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(value, pretrained[name]), name
    # The same probe on the checkpoint alone, in one process: the same shots (the rows' order does not
    # depend on the world size) and the same figure, up to one test image where a float differs.
    loader = ["--set", "data.backend=torch", "--set", "data.workers=0"]
    result = vitforge("eval", "tiny_cpu", "--checkpoint", data / "runs" / "mpp", "--fewshot", "5", "--set", probe,
                      *loader)
    probed = json.loads(result.stdout.strip().splitlines()[-1])
    assert probed["eval_fewshot_digits_5shot_images"] == final["eval_fewshot_digits_5shot_images"]
    assert abs(probed["eval_fewshot_digits_5shot"] - final["eval_fewshot_digits_5shot"]) <= 0.02, (probed, final)
    assert "eval_colour_top1" not in probed  # only what was asked for: no data.val
    assert torch.count_nonzero(classifier.head.weight) == 0
    tuned_logs = tmp_path / "tuned"
    tuned = train(data, "mpp_tuned", "train.steps=60", "train.eval_every=60", "train.log_every=10",
                  f"checkpoint.init_from={data / 'runs' / 'mpp'}", f"checkpoint.log_dir={tuned_logs}")
    assert "colour head dropped; its encoder kept" in tuned.stderr
    result = [json.loads(line) for line in (tuned_logs / "metrics.jsonl").read_text().splitlines()][-1]
    assert result["eval_top1"] > 0.3  # 10 classes: chance is 0.1


def test_masked_patch_prediction_refuses_classification_only_settings(data):
    from common.cli import train_args

    result = vitforge("train", *train_args(data, "mpp_bad", "train.objective=masked_patch_prediction",
                                           "augment.mixup=0.8"), check=False)
    assert result.returncode == 2 and "augment.mixup" in result.stderr
    assert "only apply to classification" in result.stderr
