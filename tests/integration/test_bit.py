"""The BiT ResNet baseline (ResNet-v2, group norm, weight standardisation) through the ViTs' trainer,
checkpoints and export; and the ViT-only settings it refuses. (Its parameter and FLOP counts, new
head and recipes: tests/unit/test_trainer_model.py and test_trainer_engine.py.)"""

from __future__ import annotations

import json

import pytest

from common.checks import assert_same_weights, losses, weights
from common.cli import EXTENSIONS, train, train_args, vitforge
from vitforge.trainer import ConfigError, build_model, check_model_config, is_vit
from vitforge.trainer.config import ModelConfig

# The BiT way (bit_tiny_cpu.yaml) on the shared 10-class corpus, through tiny_cpu's other settings.
BIT = ["model.name=bit_tiny_cpu", "optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.weight_decay=1e-4",
       "optimizer.schedule=step", "optimizer.decay_at=[0.5]", "optimizer.warmup_steps=2", "optimizer.grad_clip=0",
       "train.steps=8", "train.log_every=1", "train.checkpoint_every=4", "data.val=null"]


@pytest.mark.slow
def test_the_tiny_bit_trains_resumes_exactly_and_exports(data, tmp_path):
    """2 ranks, ZeRO-2: trained 8 steps, then trained again from its step-4 checkpoint, it logs the
    same losses and ends with the same weights, bit for bit; the export loads strictly into the
    model it names."""
    from safetensors.torch import load_file

    run = data / "runs" / "bit"
    train(data, "bit", *BIT, f"checkpoint.log_dir={tmp_path / 'straight'}")
    straight_weights = weights(str(run))
    again = train(data, "bit", *BIT, f"checkpoint.log_dir={tmp_path / 'resumed'}", "checkpoint.resume=4")
    assert "at step 4" in again.stderr
    straight = losses(tmp_path / "straight")
    assert sorted(straight) == list(range(1, 9)) and losses(tmp_path / "resumed") == straight
    assert_same_weights(weights(str(run)), straight_weights)
    rates = {m["step"]: m["lr"] for m in map(json.loads, (tmp_path / "straight" / "metrics.jsonl").read_text()
                                             .splitlines()) if "lr" in m}
    assert rates[3] == pytest.approx(0.1) and rates[8] == pytest.approx(0.01)  # x0.1 from half-way on

    out = tmp_path / "bit.safetensors"
    vitforge("ckpt", "export", run, "--out", out)
    description = json.loads((tmp_path / "bit.json").read_text())
    assert description["model"] == "bit_tiny_cpu" and description["num_classes"] == 10
    assert not description["pre_logits"]
    model = build_model("bit_tiny_cpu", 10, 32)
    state = load_file(out)
    model.load_state_dict(state, strict=True)
    assert state["head.fc.weight"].shape == (10, 128, 1, 1)  # timm's ResNetV2 head: a 1x1 convolution
    assert_same_weights(state, straight_weights)
    # The paper's figures read a ViT's position embeddings and attention: a clear refusal.
    inspect = vitforge("inspect", run, "--out", tmp_path / "figures", check=False)
    assert inspect.returncode == 2 and "bit_tiny_cpu is not a ViT" in inspect.stderr, inspect.stderr[-2000:]


@pytest.mark.slow
def test_vit_only_settings_are_refused_naming_the_setting(data):
    with pytest.raises(ConfigError, match="model.name: unknown model 'resnetv2_51x1_bit'"):
        is_vit("resnetv2_51x1_bit")
    with pytest.raises(ConfigError, match="model.pre_logits: bit_tiny_cpu is not a ViT: .*set model.pre_logits=false"):
        build_model("bit_tiny_cpu", 10, 32, pre_logits=True)
    with pytest.raises(ConfigError, match="model.dropout: resnetv2_50x1_bit is not a ViT: .*set model.dropout=0"):
        build_model("resnetv2_50x1_bit", 10, 224, dropout=0.1)
    with pytest.raises(ConfigError, match="model.compile: bit_tiny_cpu is not a ViT: it compiles transformer blocks"):
        check_model_config(ModelConfig(name="bit_tiny_cpu", compile=True))
    with pytest.raises(ConfigError, match="train.objective masked_patch_prediction works on a ViT's patches: "
                                          "model.name bit_tiny_cpu is not a ViT"):
        check_model_config(ModelConfig(name="bit_tiny_cpu"), "masked_patch_prediction")
    check_model_config(ModelConfig(name="vit_tiny_cpu", compile=True, pre_logits=True, dropout=0.1))
    check_model_config(ModelConfig(name="bit_tiny_cpu", drop_path=0.1, grad_checkpointing=True))
    result = vitforge("train", *train_args(data, "bit_prelogits", "model.name=bit_tiny_cpu", "model.pre_logits=true"),
                      env=EXTENSIONS, check=False)
    assert result.returncode == 2 and "model.pre_logits: bit_tiny_cpu is not a ViT" in result.stderr
    assert "Traceback" not in result.stderr
