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

from .config import ConfigError
from .objective import get_objective
from .objectives import DEFAULT_OBJECTIVE

# Tiny configurations for CPU tests and demos, built like the real ones.
TINY_MODELS = {
    "vit_tiny_cpu": dict(patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0),
    "vit_small_cpu": dict(patch_size=8, embed_dim=128, depth=4, num_heads=4, mlp_ratio=4.0),
}
# The paper's hybrids (section 3.1: a ResNet's feature map, cut into 1x1 patches, feeds the
# transformer) come from timm (vit_base_r50_s16_224, vit_large_r50_s32_224, ...); this one is its
# CPU-sized sibling: ResNet stem (7x7/2 conv, 3x3/2 max-pool) and one bottleneck stage, 8x8 tokens at 32 px.
TINY_HYBRIDS = {
    "vit_hybrid_tiny_cpu": dict(backbone=dict(layers=(1,), channels=(128,), stem_chs=32), embed_dim=64, depth=2,
                                num_heads=2, mlp_ratio=2.0),
}
# The ViT paper's baseline, BiT (Kolesnikov et al., "Big Transfer", arXiv 1912.11370): ResNet-v2 with
# group norm and weight-standardised convolutions, from timm (resnetv2_50x1_bit, resnetv2_101x3_bit, ...);
# this one is its CPU-sized sibling, built as timm builds those: the fixed-padding 7x7/2 stem and 3x3/2
# max-pool, pre-activation bottlenecks, StdConv2d with eps 1e-8. Two stages of one block, 4x4 features at 32 px.
TINY_RESNETS = {
    "bit_tiny_cpu": dict(layers=(1, 1), channels=(64, 128), stem_chs=16, num_groups=8),
}
# Dense bf16 peak FLOP/s per device (NVIDIA data sheets, SXM parts; Google's TPU v3: 123 TFLOP/s
# per chip of 2 cores). MFU = model FLOPs/s / peak.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "TPUv3-core": 61.5e12}
# The ViT paper's Table 1: parameter counts the timm configurations must match.
PAPER_PARAMETERS = {"vit_base_patch16_224": 86e6, "vit_large_patch16_224": 307e6, "vit_huge_patch14_224": 632e6}


def check_model_name(name: str) -> None:
    """An unknown model is a config error naming the key, before any process group or data."""
    if name not in TINY_MODELS and name not in TINY_HYBRIDS and name not in TINY_RESNETS and not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:8] if name else []
        tiny = ", ".join([*TINY_MODELS, *TINY_HYBRIDS, *TINY_RESNETS])
        raise ConfigError(f"model.name: unknown model {name!r} (tiny ones: {tiny}"
                          f"{'; timm has e.g. ' + ', '.join(close) if close else ''})")


# timm's modules whose every model is a VisionTransformer (or a subclass): a hybrid's is one too.
VIT_MODULES = ("vision_transformer", "vision_transformer_hybrid", "deit")


def is_vit(name: str) -> bool:
    """Whether `name` is a Vision Transformer (timm's VisionTransformer: patch embedding, position
    embeddings, transformer blocks; a hybrid is one), not a BiT ResNet or another timm model.
    Decided by the timm module that registers it, so nothing is built (it runs inside zero.Init and
    on every rank at start-up). An unknown name is check_model_name's ConfigError."""
    check_model_name(name)
    if name in TINY_RESNETS:
        return False
    if name in TINY_MODELS or name in TINY_HYBRIDS:
        return True
    return timm.models.model_entrypoint(name).__module__.rsplit(".", 1)[-1] in VIT_MODULES


# Settings that only mean something for a ViT: (the value a ResNet needs, why).
VIT_ONLY = {
    "pre_logits": ("false", "the paper's pre-training head is sized by a ViT's embed_dim; a BiT ResNet's "
                            "representation is its globally pooled features, with no layer between them and the "
                            "classifier"),
    "dropout": ("0", "it is the ViT paper's dropout after the position embeddings and dense layers, which a "
                     "ResNet does not have (BiT trains without dropout)"),
    "compile": ("false", "it compiles transformer blocks, which a ResNet does not have"),
}


def check_model_config(model, objective: str = DEFAULT_OBJECTIVE) -> None:
    """`model` (a ModelConfig) names a known model that `objective` can train and sets nothing that
    model cannot use: a ConfigError naming the setting, before any process group or data."""
    if get_objective(objective).vit_only and not is_vit(model.name):
        raise ConfigError(f"train.objective {objective} works on a ViT's patches: model.name {model.name} is not a ViT")
    _refuse_vit_settings(model.name, pre_logits=model.pre_logits, dropout=model.dropout > 0, compile=model.compile)


def _refuse_vit_settings(name: str, **settings: bool) -> None:
    if is_vit(name):
        return
    for key, used in settings.items():
        if used:
            value, why = VIT_ONLY[key]
            raise ConfigError(f"model.{key}: {name} is not a ViT: {why}; set model.{key}={value}")


def build_model(name: str, num_classes: int, image_size: int, drop_path: float = 0.0, dropout: float = 0.0,
                pre_logits: bool = False, objective: str = DEFAULT_OBJECTIVE) -> torch.nn.Module:
    """The model `objective` trains, around the ViT or BiT ResNet `name` (its head:
    objective.Objective.build). A ViT-only setting on a ResNet is a ConfigError naming it."""
    _refuse_vit_settings(name, pre_logits=pre_logits, dropout=dropout > 0)
    return get_objective(objective).build(partial(_build, name, image_size=image_size, drop_path=drop_path,
                                                  dropout=dropout), num_classes, pre_logits)


def _build(name: str, num_classes: int, *, image_size: int, drop_path: float, dropout: float) -> torch.nn.Module:
    # The paper's dropout: after the position embeddings and every dense layer except qkv (timm's
    # proj_drop covers the attention output and MLP layers, drop_rate the input of the head).
    regularisation = dict(drop_path_rate=drop_path, pos_drop_rate=dropout, proj_drop_rate=dropout, drop_rate=dropout)
    if name in TINY_MODELS:
        return VisionTransformer(img_size=image_size, num_classes=num_classes, **regularisation, **TINY_MODELS[name])
    if name in TINY_HYBRIDS:
        layout = dict(TINY_HYBRIDS[name])
        backbone = ResNetV2(**layout.pop("backbone"), num_classes=0, global_pool="", preact=False, stem_type="fixed")
        return VisionTransformer(img_size=image_size, patch_size=1, num_classes=num_classes, **regularisation,
                                 embed_layer=partial(HybridEmbed, backbone=backbone), **layout)
    if name in TINY_RESNETS:
        layout = dict(TINY_RESNETS[name])
        norm = partial(GroupNormAct, num_groups=layout.pop("num_groups"))
        return ResNetV2(**layout, num_classes=num_classes, stem_type="fixed", conv_layer=partial(StdConv2d, eps=1e-8),
                        norm_layer=norm, drop_path_rate=drop_path)
    # A ResNet takes any input size (global pooling) and has none of the ViT's dropout (refused above).
    settings = dict(img_size=image_size, **regularisation) if is_vit(name) else dict(drop_path_rate=drop_path)
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
        state["pos_embed"] = resample_abs_pos_embed(state["pos_embed"], new_size=model.patch_embed.grid_size,
                                                    num_prefix_tokens=model.num_prefix_tokens)
        side = int(math.isqrt(old))
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
    decay, no_decay = [], []
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
