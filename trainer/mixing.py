"""Soft training targets: label smoothing, and Mixup / CutMix on the device batch.

Each micro-batch's draws (whether to mix, Mixup or CutMix, lambda, the CutMix box) come from a
generator seeded by (seed, step, micro-batch, rank), so a resumed run mixes exactly as an
uninterrupted one. Sample i is mixed with sample N-1-i of the same batch (timm's "batch" mode),
and lambda is corrected to the pasted box's true area for CutMix. A sample with label -1 (replaced
or padding) has an all-zero target: it adds nothing to the loss, also where it is mixed into another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vitforge.pipeline import IGNORE_LABEL


@dataclass(frozen=True)
class Mixing:
    num_classes: int
    seed: int
    mixup: float = 0.0  # Beta(alpha, alpha); 0 = off
    cutmix: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    smoothing: float = 0.0

    @property
    def soft(self) -> bool:
        """Whether targets are distributions rather than class ids."""
        return self.mixup > 0 or self.cutmix > 0 or self.smoothing > 0


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """One row per sample: 1 - smoothing + smoothing / C on the label, smoothing / C elsewhere;
    all zeros for label -1."""
    valid = labels != IGNORE_LABEL
    targets = torch.full((len(labels), num_classes), smoothing / num_classes, device=labels.device)
    targets[torch.arange(len(labels), device=labels.device), labels.clamp(min=0)] += 1 - smoothing
    return targets * valid[:, None]


def mix_batch(
    images: torch.Tensor, labels: torch.Tensor, mixing: Mixing, step: int, micro: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, soft targets) for one training micro-batch; the inputs are not modified."""
    targets = soft_targets(labels, mixing.num_classes, mixing.smoothing)
    rng = np.random.default_rng([mixing.seed, step, micro, rank])
    if not (mixing.mixup > 0 or mixing.cutmix > 0) or rng.random() >= mixing.prob:
        return images, targets
    use_cutmix = mixing.cutmix > 0 and (mixing.mixup <= 0 or rng.random() < mixing.switch_prob)
    alpha = mixing.cutmix if use_cutmix else mixing.mixup
    lam = float(rng.beta(alpha, alpha))
    partner = images.flip(0)
    if use_cutmix:
        height, width = images.shape[-2:]
        y0, y1, x0, x1 = cutmix_box(height, width, lam, rng)
        images = images.clone()
        images[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
        lam = 1 - (y1 - y0) * (x1 - x0) / (height * width)
    else:
        images = images * lam + partner * (1 - lam)
    return images, lam * targets + (1 - lam) * targets.flip(0)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A box of area about (1 - lam) of the image, centred uniformly, clipped to the image
    (Yun et al., 2019): rows y0:y1, columns x0:x1."""
    cut = math.sqrt(1 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    y0, y1 = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, height)
    x0, x1 = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, width)
    return int(y0), int(y1), int(x0), int(x1)
