"""What the model is trained to do, behind a name: the loss, and the metrics evaluation reports.

Image classification, and masked patch prediction (self-supervised: the targets come from the
pixels). Each is an entry in OBJECTIVES: its model inputs and targets from a batch, its loss, what
evaluation counts and reports, and which part of its model `vitforge ckpt export` gives to timm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vitforge.pipeline import IGNORE_LABEL, IMAGENET_MEAN, IMAGENET_STD

from .masked_patches import UNTOUCHED, colour_targets, corruption


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
    return torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                         (top5[:, 0] == labels).sum().item(),
                         (top5 == labels[:, None]).any(dim=1).sum().item(), len(labels)], dtype=torch.float64)


def classification_metrics(totals: torch.Tensor) -> dict:
    count = max(totals[3].item(), 1)
    return {"eval_loss": totals[0].item() / count, "eval_top1": totals[1].item() / count,
            "eval_top5": totals[2].item() / count, "eval_samples": int(totals[3].item())}


def classification_inputs(batch: dict, module: torch.nn.Module, epoch: int, seed: int) -> tuple[tuple, torch.Tensor]:
    return (batch["image"],), batch["label"]


def masked_patch_inputs(batch: dict, module: torch.nn.Module, epoch: int, seed: int) -> tuple[tuple, torch.Tensor]:
    """The corrupted patches' plan and their colour classes (-1 for the rest, and for every patch of
    a sample the loader marked not real: replaced, or eval padding), from the pixels the model sees.
    Class labels play no part: the data may have none."""
    images = batch["image"]
    grid = tuple(module.vit.patch_embed.grid_size)
    action, source = (torch.from_numpy(a).to(images.device)
                      for a in corruption(seed, epoch, batch["position"].numpy(), grid[0] * grid[1]))
    mean, std = (torch.tensor(v, device=images.device).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    targets = colour_targets(images.float() * std + mean, grid)
    skipped = ~batch["real"].to(images.device).view(-1, 1)
    targets = targets.masked_fill((action == UNTOUCHED) | skipped, IGNORE_LABEL)
    return (images, action, source), targets


def whole_model(model: torch.nn.Module) -> torch.nn.Module:
    return model


def encoder(model: torch.nn.Module) -> torch.nn.Module:
    """The ViT inside a MaskedPatchModel; the [mask] embedding and the colour head stay outside."""
    return model.vit


def per_patch(function: Callable) -> Callable:
    """A per-image function applied to every patch: (batch, patches, classes) logits, (batch, patches) targets."""
    return lambda logits, targets: function(logits.flatten(0, 1), targets.flatten())


def masked_patch_metrics(totals: torch.Tensor) -> dict:
    count = max(totals[3].item(), 1)
    return {"eval_loss": totals[0].item() / count, "eval_colour_top1": totals[1].item() / count,
            "eval_colour_top5": totals[2].item() / count, "eval_patches": int(totals[3].item())}


@dataclass(frozen=True)
class Objective:
    name: str
    # (batch, the model without its engine, epoch, seed) -> (the model's inputs, the loss's targets)
    inputs: Callable[[dict, torch.nn.Module, int, int], tuple[tuple, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_counts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # summed over batches and ranks
    eval_metrics: Callable[[torch.Tensor], dict]
    # the model (not its engine) -> the timm VisionTransformer an export writes; the rest of the
    # model's parameters are the objective's own pre-training head
    exported: Callable[[torch.nn.Module], torch.nn.Module]


OBJECTIVES = {
    "classification": Objective("classification", classification_inputs, masked_loss, classification_counts,
                                classification_metrics, whole_model),
    "masked_patch_prediction": Objective("masked_patch_prediction", masked_patch_inputs, per_patch(masked_loss),
                                         per_patch(classification_counts), masked_patch_metrics, encoder),
}
