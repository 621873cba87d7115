"""timm Vision Transformers and the BiT ResNets they are compared with: construction, parameter
counts, FLOPs, and fine-tuning surgery.

Model code here knows nothing of DeepSpeed, devices or files: the engine applies parallelism from
outside, checkpoint code does I/O.
"""

from __future__ import annotations

import math
from functools import partial

import timm
import torch
from timm.layers import GroupNormAct, HybridEmbed, StdConv2d, resample_abs_pos_embed
from timm.models.resnetv2 import ResNetV2
from timm.models.vision_transformer import VisionTransformer
from torch.utils.flop_counter import FlopCounterMode

from .errors import ConfigError
from .model_names import TINY_HYBRIDS, TINY_MODELS, TINY_RESNETS, is_vit, refuse_vit_settings
from .objective import get_objective
from .objectives import DEFAULT_OBJECTIVE

# Dense bf16 peak FLOP/s per device (NVIDIA data sheets, SXM parts; Google's TPU v3: 123 TFLOP/s
# per chip of 2 cores). MFU = model FLOPs/s / peak.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "TPUv3-core": 61.5e12}
# The ViT paper's Table 1: parameter counts the timm configurations must match.
PAPER_PARAMETERS = {"vit_base_patch16_224": 86e6, "vit_large_patch16_224": 307e6, "vit_huge_patch14_224": 632e6}


def build_model(
    name: str,
    num_classes: int,
    image_size: int,
    drop_path: float = 0.0,
    dropout: float = 0.0,
    pre_logits: bool = False,
    objective: str = DEFAULT_OBJECTIVE,
) -> torch.nn.Module:
    """The model `objective` trains, around the ViT or BiT ResNet `name` (its head:
    objective.Objective.build). A ViT-only setting on a ResNet is a ConfigError naming it."""
    refuse_vit_settings(name, pre_logits=pre_logits, dropout=dropout > 0)
    return get_objective(objective).build(
        partial(_build, name, image_size=image_size, drop_path=drop_path, dropout=dropout), num_classes, pre_logits
    )


def _build(name: str, num_classes: int, *, image_size: int, drop_path: float, dropout: float) -> torch.nn.Module:
    # The paper's dropout: after the position embeddings and every dense layer except qkv (timm's
    # proj_drop covers the attention output and MLP layers, drop_rate the input of the head).
    regularisation = {
        "drop_path_rate": drop_path,
        "pos_drop_rate": dropout,
        "proj_drop_rate": dropout,
        "drop_rate": dropout,
    }
    if name in TINY_MODELS:
        return VisionTransformer(img_size=image_size, num_classes=num_classes, **regularisation, **TINY_MODELS[name])
    if name in TINY_HYBRIDS:
        layout = dict(TINY_HYBRIDS[name])
        backbone = ResNetV2(**layout.pop("backbone"), num_classes=0, global_pool="", preact=False, stem_type="fixed")
        return VisionTransformer(
            img_size=image_size,
            patch_size=1,
            num_classes=num_classes,
            **regularisation,
            embed_layer=partial(HybridEmbed, backbone=backbone),
            **layout,
        )
    if name in TINY_RESNETS:
        layout = dict(TINY_RESNETS[name])
        norm = partial(GroupNormAct, num_groups=layout.pop("num_groups"))
        return ResNetV2(
            **layout,
            num_classes=num_classes,
            stem_type="fixed",
            conv_layer=partial(StdConv2d, eps=1e-8),
            norm_layer=norm,
            drop_path_rate=drop_path,
        )
    # A ResNet takes any input size (global pooling) and has none of the ViT's dropout (refused above).
    settings = dict(img_size=image_size, **regularisation) if is_vit(name) else {"drop_path_rate": drop_path}
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **settings)
    except RuntimeError as e:
        raise ConfigError(f"model.name {name!r}: {e}") from None


def parameter_count(name: str, num_classes: int = 1000, image_size: int = 224) -> int:
    """Counted on the meta device: no memory, so ViT-H/14 counts on a laptop."""
    with torch.device("meta"):
        model = build_model(name, num_classes, image_size)
    return sum(p.numel() for p in model.parameters())


def forward_flops(name: str, image_size: int, num_classes: int = 1000, objective: str = DEFAULT_OBJECTIVE) -> float:
    """Forward FLOPs per image (2 x multiply-adds) of every matmul and convolution, a hybrid's ResNet
    stem included, counted by torch's FLOP counter on the meta device (nothing is allocated, so
    ViT-H/14 counts on a laptop). ViT-H/14 at 224 px: 167.3 GMACs."""
    with torch.device("meta"):
        model = build_model(name, num_classes, image_size, objective=objective)
        inputs = get_objective(objective).example_inputs(model, image_size)
    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    return float(counter.get_total_flops())


def adapt_state_dict(state: dict, model: torch.nn.Module) -> tuple[dict, list[str]]:
    """Fit a ViT or BiT ResNet state dict to `model`: resample a ViT's position embeddings to its
    patch grid (2D, bicubic, as the ViT paper fine-tunes at higher resolution; a ResNet has none: it
    pools globally at any resolution) and replace a head of another size or shape (a ViT's
    head.weight, a ResNet's 1x1 convolution head.fc.weight) with a zero-initialised classifier, as
    BiT fine-tunes too.
    Returns the state dict and what was changed."""
    state = dict(state)
    changed = []
    target = model.state_dict()
    if "mask_token" in state and "mask_token" not in target:  # from masked patch prediction: the encoder
        state = {k.removeprefix("vit."): v for k, v in state.items() if k.startswith("vit.")}
        changed.append("masked patch prediction's [mask] embedding and colour head dropped; its encoder kept")
    if "pos_embed" in state and state["pos_embed"].shape != target["pos_embed"].shape:
        old = state["pos_embed"].shape[1] - model.num_prefix_tokens
        state["pos_embed"] = resample_abs_pos_embed(
            state["pos_embed"], new_size=model.patch_embed.grid_size, num_prefix_tokens=model.num_prefix_tokens
        )
        side = math.isqrt(old)
        changed.append(f"pos_embed {side}x{side} -> {'x'.join(map(str, model.patch_embed.grid_size))}")
    # Fine-tuning (paper section 3.1): the pre-training head goes, pre-logits layer included, and a
    # zero-initialised classifier for the new classes takes its place.
    for key in sorted(k for k in {*state, *target} if k.startswith("head.")):
        if key not in target:
            del state[key]
            changed.append(f"{key} dropped (the pre-training head's representation layer)")
        elif key not in state or state[key].shape != target[key].shape:
            state[key] = target[key] if key.startswith("head.pre_logits.") else torch.zeros_like(target[key])
            how = "initialised" if key.startswith("head.pre_logits.") else "zero-initialised"
            changed.append(f"{key} {tuple(target[key].shape)} {how} for {model.num_classes} classes")
    return state, changed


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms, biases, position embeddings and the class token (1-D or named)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
