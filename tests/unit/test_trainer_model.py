"""The models (trainer/model.py): parameter and FLOP counts against the paper and a hand count, for
ViTs, hybrids and BiT ResNets; and a checkpoint adapted to a new head or resolution, the pre-training
head dropped and the new classifier zero-initialised."""

from __future__ import annotations

import math

import pytest
import torch

from vitforge.trainer import (PAPER_PARAMETERS, adapt_state_dict, build_model, forward_flops, get_objective,
                              parameter_count)


def test_parameter_counts_match_the_paper():
    for name, paper in PAPER_PARAMETERS.items():
        assert abs(parameter_count(name) - paper) / paper < 0.015, name


def analytic_vit_flops(model) -> float:
    """The ViT count by hand (2 x multiply-adds): per block QKV and output projections 4*N*D^2, MLP
    2*N*D*H, attention scores and values 2*N^2*D; plus the patch embedding and the head."""
    dim, patches = model.embed_dim, model.patch_embed.num_patches
    tokens, hidden = patches + model.num_prefix_tokens, model.blocks[0].mlp.fc1.out_features
    per_block = 4 * tokens * dim * dim + 2 * tokens * dim * hidden + 2 * tokens * tokens * dim
    patch_embed = patches * dim * math.prod(model.patch_embed.proj.weight.shape[1:])
    return 2.0 * (len(model.blocks) * per_block + patch_embed + dim * model.num_classes)


@pytest.mark.parametrize("name,size", [("vit_tiny_cpu", 32), ("vit_base_patch16_224", 224),
                                       ("vit_huge_patch14_224", 224), ("vit_huge_patch14_224", 518)])
def test_counted_flops_equal_the_analytic_vit_count(name, size):
    with torch.device("meta"):
        model = build_model(name, 1000, size)
    assert forward_flops(name, size) == analytic_vit_flops(model)
    if (name, size) == ("vit_huge_patch14_224", 224):
        assert abs(forward_flops(name, size) / 2 - 167.4e9) / 167.4e9 < 0.005  # the paper's 167.4 GMACs


@pytest.mark.parametrize("name,size", [("vit_hybrid_tiny_cpu", 32), ("vit_base_r50_s16_224", 224)])
def test_a_hybrid_counts_its_resnet_stem_too(name, size):
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_model(name, 1000, size)
        images = torch.empty(1, 3, size, size)
    with FlopCounterMode(display=False) as stem:
        model.patch_embed.backbone(images)
    assert stem.get_total_flops() > 0.1 * analytic_vit_flops(model)  # a stem worth counting
    assert forward_flops(name, size) == stem.get_total_flops() + analytic_vit_flops(model)


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


def test_position_embeddings_interpolate_for_higher_resolution():
    torch.manual_seed(0)
    original = build_model("vit_small_cpu", 10, 32).eval()
    images = torch.randn(2, 3, 32, 32)
    state = original.state_dict()
    same, changed = adapt_state_dict(state, build_model("vit_small_cpu", 10, 32))
    assert changed == []
    copy = build_model("vit_small_cpu", 10, 32).eval()
    copy.load_state_dict(same)
    assert torch.equal(copy(images), original(images))
    bigger = build_model("vit_small_cpu", 7, 64).eval()
    adapted, changed = adapt_state_dict(state, bigger)
    assert adapted["pos_embed"].shape == (1, 1 + 8 * 8, 128) and "pos_embed 4x4 -> 8x8" in changed[0]
    assert any("head.weight" in c for c in changed)
    bigger.load_state_dict(adapted, strict=True)
    assert bigger(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    # Upsampled 4x4 -> 8x8 embeddings still carry the original grid: resampled back to 4x4 they
    # give nearly the original model's features at the original resolution.
    from timm.layers import resample_abs_pos_embed

    back = resample_abs_pos_embed(adapted["pos_embed"], new_size=(4, 4), num_prefix_tokens=1)
    restored = build_model("vit_small_cpu", 10, 32).eval()
    restored.load_state_dict({**state, "pos_embed": back})
    a, b = original.forward_features(images), restored.forward_features(images)
    assert torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1)).min() > 0.99


def test_the_pre_training_head_is_dropped_for_a_zero_initialised_classifier():
    """Paper section 3.1: pre-train with a tanh pre-logits layer; fine-tune with one zero-initialised
    linear layer, the rest of the network as it was."""
    torch.manual_seed(0)
    pretrained = build_model("vit_tiny_cpu", 10, 32, pre_logits=True)
    assert {k for k in pretrained.state_dict() if k.startswith("head.")} == {
        "head.pre_logits.weight", "head.pre_logits.bias", "head.fc.weight", "head.fc.bias"}
    images = torch.randn(3, 3, 32, 32)
    hidden = torch.tanh(pretrained.head.pre_logits(pretrained.forward_head(pretrained.forward_features(images),
                                                                           pre_logits=True)))
    assert torch.allclose(pretrained(images), pretrained.head.fc(hidden))
    tuned = build_model("vit_tiny_cpu", 7, 32)
    state, changed = adapt_state_dict(pretrained.state_dict(), tuned)
    assert "head.pre_logits.weight dropped (the pre-training head's representation layer)" in changed
    assert "head.weight (7, 64) zero-initialised for 7 classes" in changed
    tuned.load_state_dict(state, strict=True)
    assert torch.count_nonzero(tuned.head.weight) == 0 and torch.count_nonzero(tuned.head.bias) == 0
    assert torch.equal(tuned.forward_features(images), pretrained.forward_features(images))
    again = build_model("vit_tiny_cpu", 10, 32, pre_logits=True)
    kept, changed = adapt_state_dict(pretrained.state_dict(), again)
    assert changed == [] and all(torch.equal(kept[k], v) for k, v in pretrained.state_dict().items())


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
