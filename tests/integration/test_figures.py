"""The paper's figures: `vitforge inspect` on a trained checkpoint (PNGs written, numbers.json equal
to the computation on the exported weights). (Known-answer inputs for each computation:
tests/unit/test_trainer_figures.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.cli import train, vitforge


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vit_tiny_cpu", "vit_hybrid_tiny_cpu"])
def test_inspect_writes_the_figures_and_the_numbers_of_a_trained_checkpoint(data, straight, tmp_path, model):
    from safetensors.torch import load_file

    from vitforge.pipeline import LoaderSpec, build_loader
    from vitforge.trainer import build_model
    from vitforge.trainer.figures import compute

    run = straight  # any finished run of the model will do: the session's reference run is one
    if model != "vit_tiny_cpu":
        run = data / "runs" / f"figures_{model}"
        train(data, run.name, f"model.name={model}", "train.steps=4", "train.checkpoint_every=4", "data.val=null")
    out = tmp_path / "figures"
    result = vitforge("inspect", run, "--images", data / "val", "--count", "4", "--out", out)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {"position_similarity.png", "mean_attention_distance.png", "attention_rollout.png", "numbers.json"}
    if model == "vit_tiny_cpu":
        expected.add("embedding_filters.png")  # a hybrid's embedding sees ResNet features, not RGB
    assert {p.name for p in out.iterdir()} == expected and all((out / n).stat().st_size > 1000 for n in expected)
    numbers = json.loads((out / "numbers.json").read_text())
    vitforge("ckpt", "export", run, "--out", tmp_path / "m.safetensors")
    net = build_model(model, 10, 32)
    net.load_state_dict(load_file(tmp_path / "m.safetensors"))
    images = next(iter(build_loader(LoaderSpec(str(data / "val"), batch_size=4, image_size=32, train=False,
                                               backend="torch", workers=0))))["image"]
    again = compute(net, images)
    assert numbers["grid"] == summary["grid"] == list(again["grid"])
    for key in ("position_similarity", "mean_attention_distance", "rollout"):
        assert np.allclose(numbers[key], again[key], atol=1e-6), key
    assert len(numbers["mean_attention_distance"]) == 2 and len(numbers["mean_attention_distance"][0]) == 2
