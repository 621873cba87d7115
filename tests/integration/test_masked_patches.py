"""Masked patch prediction end to end: pre-training that learns, and fine-tuning that starts from the
pre-trained encoder. (The corruption, the colour targets and the model's inputs, in-process:
tests/unit/test_trainer_masked_patches.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from common.checks import losses
from common.cli import train, vitforge


@pytest.mark.slow
def test_pre_training_learns_colours_and_fine_tuning_starts_from_its_encoder(data, tmp_path):
    from safetensors.torch import load_file

    from vitforge.trainer import adapt_state_dict, build_model

    # Pre-training needs no labels: the same images, sharded without them.
    for split in ("train", "val"):
        vitforge("shard", data / f"{split}_src", tmp_path / split, "--no-labels", "--shard-samples", "64",
                 "--workers", "2")
    logs = tmp_path / "mpp"
    # The few-shot probe reads the encoder's features: no head, and no labels in the training
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
