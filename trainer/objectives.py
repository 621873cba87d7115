"""The objectives by name, without torch: what validating a config needs to know of each (that it
exists, and which settings it refuses). Their models, inputs, losses and metrics (objective.py,
torch) are imported when a run, an evaluation or an export first asks for one, which then takes
its name's place in the table.

Cost: one entry per objective (a handful), in every process that validates a config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vitforge.core import registry

from .errors import ConfigError

if TYPE_CHECKING:
    from .objective import Objective

# What a checkpoint saved before manifests named their objective was trained for.
DEFAULT_OBJECTIVE = "classification"


def no_check(cfg) -> None:
    return None


def refuse_classification_settings(cfg) -> None:
    mixing = [f"augment.{k}" for k in ("mixup", "cutmix", "label_smoothing") if getattr(cfg.augment, k)]
    if mixing or cfg.model.pre_logits:
        raise ValueError(
            f"train.objective {cfg.train.objective} predicts patch colours: "
            f"{', '.join(mixing + ['model.pre_logits'] * cfg.model.pre_logits)} "
            "only apply to classification"
        )


# name -> the Objective (objective.py), or "module:attribute" naming a built-in one not imported yet
OBJECTIVES: dict[str, Objective | str] = {
    "classification": "vitforge.trainer.objective:CLASSIFICATION",
    "masked_patch_prediction": "vitforge.trainer.objective:MASKED_PATCH_PREDICTION",
}
# What the built-ins refuse, known before their module is imported (the same functions they carry),
# and those that work on a ViT's patches (their `vit_only`).
_BUILTIN_CHECKS: dict[str, Callable[[object], None]] = {"masked_patch_prediction": refuse_classification_settings}
_BUILTIN_VIT_ONLY = {"masked_patch_prediction"}


def find_objective(name: str) -> Objective:
    """The Objective registered as `name`, its module imported now; an unknown name is a ConfigError
    naming the known ones."""
    return registry.find(OBJECTIVES, name, unknown=lambda known: _unknown_objective(name))


def _unknown_objective(name: str) -> ConfigError:
    # in registration order, as the objectives are documented
    return ConfigError(f"train.objective: unknown objective {name!r} (known: {', '.join(OBJECTIVES)})")


def check_config(cfg) -> None:
    """Config validation: a known objective, and settings it can use (ValueError, for pydantic)."""
    name = cfg.train.objective
    if name not in OBJECTIVES:
        raise _unknown_objective(name)
    found = OBJECTIVES[name]
    (_BUILTIN_CHECKS.get(name, no_check) if isinstance(found, str) else found.check_config)(cfg)


def vit_only(name: str) -> bool:
    """Whether objective `name` trains only ViTs (a BiT ResNet is refused), without importing it."""
    if name not in OBJECTIVES:
        raise _unknown_objective(name)
    found = OBJECTIVES[name]
    return name in _BUILTIN_VIT_ONLY if isinstance(found, str) else found.vit_only


def saved_objective(manifest: dict) -> str:
    """The objective a checkpoint was trained for, by its manifest."""
    return manifest.get("objective", DEFAULT_OBJECTIVE)
