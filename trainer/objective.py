"""What the model is trained to do, behind a name: the loss, and the metrics evaluation reports.

One objective today (image classification); a second (e.g. masked patch prediction) is one more
entry in OBJECTIVES with the same three functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vitforge.pipeline import IGNORE_LABEL


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


@dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_counts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # summed over batches and ranks
    eval_metrics: Callable[[torch.Tensor], dict]


OBJECTIVES = {"classification": Objective("classification", masked_loss, classification_counts,
                                          classification_metrics)}
