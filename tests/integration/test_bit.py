"""The BiT ResNet baseline (ResNet-v2, group norm, weight standardisation) through the ViTs' trainer,
recipes, checkpoints and export; and the ViT-only settings it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from common.checks import assert_same_weights, losses, weights
from common.cli import EXTENSIONS, train, train_args, vitforge
from vitforge.trainer import (ConfigError, adapt_state_dict, build_model, check_model_config, forward_flops,
                              get_objective, is_vit, load_config, parameter_count)
from vitforge.trainer.config import ModelConfig
from vitforge.trainer.engine import learning_rate

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


def test_is_vit_agrees_with_the_class_timm_builds():
    import timm
    from timm.models.vision_transformer import VisionTransformer

    from vitforge.trainer.model_names import VIT_MODULES

    names = [name for module in (*VIT_MODULES, "resnetv2", "convnext") for name in timm.list_models(module=module)[:2]]
    for name in ["vit_base_r50_s16_224", "resnetv2_50x1_bit", *names]:
        with torch.device("meta"):
            assert is_vit(name) == isinstance(timm.create_model(name, num_classes=0), VisionTransformer), name
    assert is_vit("vit_tiny_cpu") and is_vit("vit_hybrid_tiny_cpu") and not is_vit("bit_tiny_cpu")


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


def analytic_resnetv2(layers, channels, stem: int, classes: int, size: int) -> tuple[int, float]:
    """(parameters, forward FLOPs = 2 x multiply-adds) of a pre-activation bottleneck ResNet-v2, by
    hand: a 7x7/2 stem convolution and 3x3/2 max-pool; per block 1x1 -> 3x3 (the stride) -> 1x1
    convolutions at a quarter of the output width, a group norm (scale and shift) before each, and a
    strided 1x1 projection in each stage's first block; a final group norm, global pooling and a 1x1
    convolution head with bias. Weight-standardised convolutions have no bias."""
    side = (size + 6 - 7) // 2 + 1  # the stem convolution
    params, macs = 7 * 7 * 3 * stem, 7 * 7 * 3 * stem * side * side
    side = (side + 2 - 3) // 2 + 1  # the max-pool (fixed padding)
    width = stem
    for stage, (blocks, out) in enumerate(zip(layers, channels)):
        mid = out // 4
        for block in range(blocks):
            stride = 2 if stage and not block else 1
            after = (side + 2 - 3) // stride + 1
            params += 2 * width + width * mid + 2 * mid + 9 * mid * mid + 2 * mid + mid * out
            macs += width * mid * side * side + 9 * mid * mid * after * after + mid * out * after * after
            if not block:
                params += width * out
                macs += width * out * after * after
            width, side = out, after
    params += 2 * width + width * classes + classes
    return params, 2.0 * (macs + width * classes)


@pytest.mark.parametrize("name, layers, channels, stem, size", [
    ("resnetv2_50x1_bit", (3, 4, 6, 3), (256, 512, 1024, 2048), 64, 224),
    ("bit_tiny_cpu", (1, 1), (64, 128), 16, 32)])
def test_parameters_and_flops_equal_the_analytic_resnet_count(name, layers, channels, stem, size):
    params, flops = analytic_resnetv2(layers, channels, stem, 1000, size)
    assert parameter_count(name, 1000, size) == params
    assert forward_flops(name, size) == flops
    if name == "resnetv2_50x1_bit":  # ResNet-50's well-known 25.5M parameters and about 4.1 GMACs at 224 px
        assert params == 25_549_352 and abs(flops / 2 - 4.09e9) < 0.01e9


def test_fine_tuning_a_resnet_zero_initialises_its_new_head():
    torch.manual_seed(0)
    pretrained = build_model("bit_tiny_cpu", 10, 32)
    images = torch.randn(3, 3, 32, 32)
    features = pretrained.forward_features(images)
    # The representation a probe reads: BiT's globally pooled features, before the classifier.
    pooled = pretrained.forward_head(features, pre_logits=True)
    assert torch.allclose(pooled, features.mean((2, 3)))
    assert torch.allclose(get_objective("classification").features(pretrained.eval(), images, None), pooled)
    tuned = build_model("bit_tiny_cpu", 7, 48)
    state, changed = adapt_state_dict(pretrained.state_dict(), tuned)
    assert changed == ["head.fc.bias (7,) zero-initialised for 7 classes",
                       "head.fc.weight (7, 128, 1, 1) zero-initialised for 7 classes"]
    tuned.load_state_dict(state, strict=True)
    assert torch.count_nonzero(tuned.head.fc.weight) == 0 and torch.count_nonzero(tuned.head.fc.bias) == 0
    assert torch.equal(tuned.forward_features(images), features)
    kept, changed = adapt_state_dict(pretrained.state_dict(), build_model("bit_tiny_cpu", 10, 32))
    assert changed == [] and all(torch.equal(kept[k], v) for k, v in pretrained.state_dict().items())


def test_the_bit_recipes_and_their_step_schedule():
    upstream = load_config("bit_r50x1_upstream")
    opt = upstream.optimizer
    assert (opt.name, opt.momentum, opt.weight_decay, opt.warmup_steps) == ("sgd", 0.9, 1e-4, 5000)
    assert opt.lr == pytest.approx(0.03 * upstream.train.global_batch / 256)
    assert upstream.train.steps == round(90 * 14_197_122 / 4096) and upstream.accumulation(64) == 1
    steps = upstream.train.steps
    for epoch, rate in ((29.9, 0.48), (30.1, 0.048), (59.9, 0.048), (60.1, 0.0048), (80.1, 0.00048)):
        assert learning_rate(upstream, int(epoch / 90 * steps)) == pytest.approx(rate)
    assert learning_rate(upstream, 0) == pytest.approx(0.48 / 5000)
    tiny = load_config("bit_tiny_cpu")
    assert tiny.model.name == "bit_tiny_cpu" and tiny.optimizer.schedule == "step"
    for bad in ("[0.6,0.3]", "[0.5,1.0]", "[0]"):
        with pytest.raises(ConfigError, match="optimizer.decay_at: decay_at must be ascending fractions"):
            load_config("bit_tiny_cpu", [f"optimizer.decay_at={bad}"])
