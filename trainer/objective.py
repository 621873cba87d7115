"""What the model is trained to do, behind a name: its head, loss, metrics, export and checks.

Image classification, and masked patch prediction (self-supervised: the targets come from the
pixels). Each is registered once in OBJECTIVES (`register_objective`; the table, and what config
validation needs of each, live torch-free in objectives.py): the model it builds around a
ViT, its model inputs and targets from a batch, its loss, what evaluation counts and reports, which
part of its model `vitforge ckpt export` gives to timm, whether it needs class labels, and which
config settings it refuses. No other module compares objective names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vitforge.pipeline import IGNORE_LABEL, IMAGENET_MEAN, IMAGENET_STD

from .masked_patches import UNTOUCHED, MaskedPatchModel, colour_targets, corruption
from .objectives import OBJECTIVES, find_objective, no_check, refuse_classification_settings


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over real labels only (-1: replaced or padding samples); 0 when there are
    none. `labels`: class ids, or soft targets (one row per sample; all zeros for a sample to
    ignore), weighted by each row's mass. No data-dependent branch, so no device sync."""
    if labels.is_floating_point():
        total = -(labels * F.log_softmax(logits.float(), dim=1)).sum()
        return total / labels.sum().clamp(min=1)
    total = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL, reduction="sum")
    return total / (labels != IGNORE_LABEL).sum().clamp(min=1)


def classification_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[loss sum, top-1 hits, top-5 hits, count] over real labels (padding and bad samples skipped)."""
    valid = labels != IGNORE_LABEL
    logits, labels = logits.float()[valid], labels[valid]
    if not len(labels):
        return torch.zeros(4, dtype=torch.float64)
    top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return torch.tensor(
        [
            F.cross_entropy(logits, labels, reduction="sum").item(),
            (top5[:, 0] == labels).sum().item(),
            (top5 == labels[:, None]).any(dim=1).sum().item(),
            len(labels),
        ],
        dtype=torch.float64,
    )


def classification_metrics(totals: torch.Tensor) -> dict:
    count = max(totals[3].item(), 1)
    return {
        "eval_loss": totals[0].item() / count,
        "eval_top1": totals[1].item() / count,
        "eval_top5": totals[2].item() / count,
        "eval_samples": int(totals[3].item()),
    }


def classification_inputs(batch: dict, module: torch.nn.Module, epoch: int, seed: int) -> tuple[tuple, torch.Tensor]:
    return (batch["image"],), batch["label"]


def masked_patch_inputs(batch: dict, module: torch.nn.Module, epoch: int, seed: int) -> tuple[tuple, torch.Tensor]:
    """The corrupted patches' plan and their colour classes (-1 for the rest, and for every patch of
    a sample the loader marked not real: replaced, or eval padding), from the pixels the model sees.
    Class labels play no part: the data may have none."""
    images = batch["image"]
    grid = tuple(module.vit.patch_embed.grid_size)
    action, source = (
        torch.from_numpy(a).to(images.device)
        for a in corruption(seed, epoch, batch["position"].numpy(), grid[0] * grid[1])
    )
    mean, std = (torch.tensor(v, device=images.device).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    targets = colour_targets(images.float() * std + mean, grid)
    skipped = ~batch["real"].to(images.device).view(-1, 1)
    targets = targets.masked_fill((action == UNTOUCHED) | skipped, IGNORE_LABEL)
    return (images, action, source), targets


class PreLogitsHead(torch.nn.Module):
    """The paper's pre-training head (section 3.1, appendix B.1.1): an MLP with one hidden tanh
    layer, the "representation" (pre-logits) layer, then the classifier."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.pre_logits = torch.nn.Linear(dim, dim)
        self.fc = torch.nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.pre_logits(x)))


def classifier(make_vit: Callable[[int], torch.nn.Module], num_classes: int, pre_logits: bool) -> torch.nn.Module:
    """`pre_logits`: the paper's pre-training head instead of a single linear classifier."""
    model = make_vit(num_classes)
    if pre_logits:
        model.head = PreLogitsHead(model.embed_dim, num_classes)
    return model


def masked_patch_model(
    make_vit: Callable[[int], torch.nn.Module], num_classes: int, pre_logits: bool
) -> torch.nn.Module:
    """The encoder (no class head) in a MaskedPatchModel; the config refuses pre_logits."""
    return MaskedPatchModel(make_vit(0))


def image_only(model: torch.nn.Module, image_size: int) -> list[torch.Tensor]:
    return [torch.empty(1, 3, image_size, image_size)]


def image_and_plan(model: torch.nn.Module, image_size: int) -> list[torch.Tensor]:
    patches = math.prod(model.vit.patch_embed.grid_size)
    return [
        *image_only(model, image_size),
        torch.zeros(1, patches, dtype=torch.long),
        torch.zeros(1, patches, dtype=torch.long),
    ]


def whole_model(model: torch.nn.Module) -> torch.nn.Module:
    return model


def encoder(model: torch.nn.Module) -> torch.nn.Module:
    """The ViT inside a MaskedPatchModel; the [mask] embedding and the colour head stay outside."""
    return model.vit


def classifier_features(model: torch.nn.Module, images: torch.Tensor, params: dict | None) -> torch.Tensor:
    """The pre-logits features: what the last classifier layer reads (the paper's tanh
    representation with its pre-training head; the pooled, normalised token with a linear head;
    a ResNet's pooled map), caught by a hook on a full forward pass, so that ZeRO-3 gathers each
    layer's parameters as it always does."""
    head = model.get_classifier()
    head = getattr(head, "fc", head)  # the paper's head: its classifier reads the tanh layer
    caught = []
    hook = head.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        torch.func.functional_call(model, params, (images,)) if params else model(images)
    finally:
        hook.remove()
    return caught[0].flatten(1)


def encoder_features(model: torch.nn.Module, images: torch.Tensor, params: dict | None) -> torch.Tensor:
    """The encoder's pooled token (as the exported ViT would give it), from a forward pass of the
    whole model with no patch corrupted: the root module's own forward, as ZeRO-3's parameter
    fetching expects, with the encoder's output caught by a hook."""
    vit = model.vit
    patches = math.prod(vit.patch_embed.grid_size)
    action = torch.full((len(images), patches), UNTOUCHED, dtype=torch.long, device=images.device)
    source = torch.arange(patches, device=images.device).expand(len(images), -1)
    caught = []
    hook = vit.norm.register_forward_hook(lambda module, args, output: caught.append(output))
    try:
        inputs = (images, action, source)
        torch.func.functional_call(model, params, inputs) if params else model(*inputs)
    finally:
        hook.remove()
    return vit.forward_head(caught[0], pre_logits=True)


def per_patch(function: Callable) -> Callable:
    """A per-image function applied to every patch: (batch, patches, classes) logits, (batch, patches) targets."""
    return lambda logits, targets: function(logits.flatten(0, 1), targets.flatten())


def masked_patch_metrics(totals: torch.Tensor) -> dict:
    count = max(totals[3].item(), 1)
    return {
        "eval_loss": totals[0].item() / count,
        "eval_colour_top1": totals[1].item() / count,
        "eval_colour_top5": totals[2].item() / count,
        "eval_patches": int(totals[3].item()),
    }


@dataclass(frozen=True)
class Objective:
    name: str
    # (a ViT maker taking its class count, the data's class count, model.pre_logits) -> the model
    build: Callable[[Callable[[int], torch.nn.Module], int, bool], torch.nn.Module]
    # (the model, image size) -> inputs of one image, for counting FLOPs on the meta device
    example_inputs: Callable[[torch.nn.Module, int], list[torch.Tensor]]
    # (batch, the model without its engine, epoch, seed) -> (the model's inputs, the loss's targets)
    inputs: Callable[[dict, torch.nn.Module, int, int], tuple[tuple, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_counts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # summed over batches and ranks
    eval_metrics: Callable[[torch.Tensor], dict]
    # the model (not its engine) -> the timm VisionTransformer an export writes; the rest of the
    # model's parameters are the objective's own pre-training head
    exported: Callable[[torch.nn.Module], torch.nn.Module]
    labelled: bool  # learns from class labels: refuses data sharded without them
    # (the model, images, weights to use instead of its own or None) -> (images, width) frozen
    # pre-logits features, for the probes
    features: Callable[[torch.nn.Module, torch.Tensor, dict | None], torch.Tensor]
    # the whole Config -> None, or a ValueError naming the settings this objective cannot use
    check_config: Callable[[object], None] = no_check
    vit_only: bool = False  # works on a ViT's patches: a BiT ResNet is refused (model.check_model_config)


def register_objective(objective: Objective) -> Objective:
    """Make an objective known by its name (train.objective, a checkpoint manifest's objective)."""
    if objective.name in OBJECTIVES:
        raise ValueError(f"objective {objective.name!r} is registered already")
    OBJECTIVES[objective.name] = objective
    return objective


def get_objective(name: str) -> Objective:
    return find_objective(name)


CLASSIFICATION = Objective(
    "classification",
    classifier,
    image_only,
    classification_inputs,
    masked_loss,
    classification_counts,
    classification_metrics,
    whole_model,
    labelled=True,
    features=classifier_features,
)
MASKED_PATCH_PREDICTION = Objective(
    "masked_patch_prediction",
    masked_patch_model,
    image_and_plan,
    masked_patch_inputs,
    per_patch(masked_loss),
    per_patch(classification_counts),
    masked_patch_metrics,
    encoder,
    labelled=False,
    features=encoder_features,
    check_config=refuse_classification_settings,
    vit_only=True,
)
# The built-ins take their names' places in the table as soon as this module is imported.
OBJECTIVES.update({o.name: o for o in (CLASSIFICATION, MASKED_PATCH_PREDICTION)})
