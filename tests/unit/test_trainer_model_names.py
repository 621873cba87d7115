"""Model names (trainer/model_names.py): which of timm's models are ViTs."""

from __future__ import annotations

import torch

from vitforge.trainer import is_vit


def test_is_vit_agrees_with_the_class_timm_builds():
    import timm
    from timm.models.vision_transformer import VisionTransformer

    from vitforge.trainer.model_names import VIT_MODULES

    names = [name for module in (*VIT_MODULES, "resnetv2", "convnext") for name in timm.list_models(module=module)[:2]]
    for name in ["vit_base_r50_s16_224", "resnetv2_50x1_bit", *names]:
        with torch.device("meta"):
            assert is_vit(name) == isinstance(timm.create_model(name, num_classes=0), VisionTransformer), name
    assert is_vit("vit_tiny_cpu") and is_vit("vit_hybrid_tiny_cpu") and not is_vit("bit_tiny_cpu")
