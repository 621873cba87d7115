"""Which models exist, which are Vision Transformers, and which settings a model refuses, without
importing timm (which imports torch): what `vitforge study` checks on a login node before it
submits anything, and what every rank checks again before it builds a model.

timm's registry is read from its source: every `@register_model` function of timm/models/*.py,
by name, with the module that registers it (a ViT's module says it is one). That is exactly
`timm.list_models()` for timm 1.0 (1,371 names), read in ~0.1 s against ~5 s of CPU to import
timm; a name the scan does not know (a deprecated alias, a plugin's model) is asked of timm itself.

Cost: one name -> module dict of timm's models (a few hundred KB), built on first use.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import os
import re
from typing import Any

from .errors import ConfigError
from .objectives import DEFAULT_OBJECTIVE, vit_only

# Tiny configurations for CPU tests and demos, built like the real ones.
TINY_MODELS = {
    "vit_tiny_cpu": {"patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0},
    "vit_small_cpu": {"patch_size": 8, "embed_dim": 128, "depth": 4, "num_heads": 4, "mlp_ratio": 4.0},
}
# The paper's hybrids (section 3.1: a ResNet's feature map, cut into 1x1 patches, feeds the
# transformer) come from timm (vit_base_r50_s16_224, vit_large_r50_s32_224, ...); this one is its
# CPU-sized sibling: ResNet stem (7x7/2 conv, 3x3/2 max-pool) and one bottleneck stage, 8x8 tokens at 32 px.
TINY_HYBRIDS: dict[str, dict[str, Any]] = {
    "vit_hybrid_tiny_cpu": {
        "backbone": {"layers": (1,), "channels": (128,), "stem_chs": 32},
        "embed_dim": 64,
        "depth": 2,
        "num_heads": 2,
        "mlp_ratio": 2.0,
    },
}
# The ViT paper's baseline, BiT (Kolesnikov et al., "Big Transfer", arXiv 1912.11370): ResNet-v2 with
# group norm and weight-standardised convolutions, from timm (resnetv2_50x1_bit, resnetv2_101x3_bit, ...);
# this one is its CPU-sized sibling, built as timm builds those: the fixed-padding 7x7/2 stem and 3x3/2
# max-pool, pre-activation bottlenecks, StdConv2d with eps 1e-8. Two stages of one block, 4x4 features at 32 px.
TINY_RESNETS = {
    "bit_tiny_cpu": {"layers": (1, 1), "channels": (64, 128), "stem_chs": 16, "num_groups": 8},
}

# timm's modules whose every model is a VisionTransformer (or a subclass): a hybrid's is one too.
VIT_MODULES = ("vision_transformer", "vision_transformer_hybrid", "deit")
_REGISTERED = re.compile(rb"@register_model\s*(?:\(\s*\))?\s*\n\s*def\s+(\w+)")


@functools.lru_cache(maxsize=1)
def timm_models() -> dict[str, str]:
    """Every model timm registers, by name -> the module (file name) registering it; {} when timm
    is not installed (then every name is asked of timm, which fails as it should)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = os.path.join(spec.submodule_search_locations[0], "models")
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                for match in _REGISTERED.finditer(f.read()):
                    found[match.group(1).decode()] = name[:-3]
    return found


def _timm_module(name: str) -> str | None:
    """The module registering `name`, by the scan or, for a name it does not know, by timm."""
    module = timm_models().get(name)
    if module is None:
        import timm

        if timm.is_model(name):
            module = timm.models.model_entrypoint(name).__module__.rsplit(".", 1)[-1]
    return module


def check_model_name(name: str) -> None:
    """An unknown model is a config error naming the key, before any process group or data."""
    if name in TINY_MODELS or name in TINY_HYBRIDS or name in TINY_RESNETS or _timm_module(name):
        return
    pattern = f"*{name.split('_')[0]}*"
    close = sorted(n for n in timm_models() if fnmatch.fnmatchcase(n, pattern))[:8] if name else []
    tiny = ", ".join([*TINY_MODELS, *TINY_HYBRIDS, *TINY_RESNETS])
    raise ConfigError(
        f"model.name: unknown model {name!r} (tiny ones: {tiny}"
        f"{'; timm has e.g. ' + ', '.join(close) if close else ''})"
    )


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
    return _timm_module(name) in VIT_MODULES


# Settings that only mean something for a ViT: (the value a ResNet needs, why).
VIT_ONLY = {
    "pre_logits": (
        "false",
        "the paper's pre-training head is sized by a ViT's embed_dim; a BiT ResNet's "
        "representation is its globally pooled features, with no layer between them and the "
        "classifier",
    ),
    "dropout": (
        "0",
        "it is the ViT paper's dropout after the position embeddings and dense layers, which a "
        "ResNet does not have (BiT trains without dropout)",
    ),
    "compile": ("false", "it compiles transformer blocks, which a ResNet does not have"),
}


def check_model_config(model, objective: str = DEFAULT_OBJECTIVE) -> None:
    """`model` (a ModelConfig) names a known model that `objective` can train and sets nothing that
    model cannot use: a ConfigError naming the setting, before any process group or data."""
    if vit_only(objective) and not is_vit(model.name):
        raise ConfigError(f"train.objective {objective} works on a ViT's patches: model.name {model.name} is not a ViT")
    refuse_vit_settings(model.name, pre_logits=model.pre_logits, dropout=model.dropout > 0, compile=model.compile)


def refuse_vit_settings(name: str, **settings: bool) -> None:
    if is_vit(name):
        return
    for key, used in settings.items():
        if used:
            value, why = VIT_ONLY[key]
            raise ConfigError(f"model.{key}: {name} is not a ViT: {why}; set model.{key}={value}")
