"""Masked patch prediction (ViT paper section 4.6, appendix B.1.2): pre-training without labels.

Half of each image's patch embeddings are corrupted: 80% of those replaced by a learnable [mask]
embedding, 10% by the embedding of another patch of the same image, 10% left as they are. The
model predicts each corrupted patch's mean colour, 3 bits per channel (512 classes), from that
patch's output token. Which patches, and how, is a function of (seed, epoch, the sample's
position in the epoch's order), like the loader's crops, so a resumed run corrupts the same ones.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from .errors import ConfigError

UNTOUCHED, MASKED, SWAPPED, KEPT = 0, 1, 2, 3  # what happened to a patch's embedding
COLOURS = 512  # 8 levels per channel
CORRUPTED_SHARE, MASK_SHARE, SWAP_SHARE = 0.5, 0.8, 0.1


def corruption(seed: int, epoch: int, positions: np.ndarray, patches: int) -> tuple[np.ndarray, np.ndarray]:
    """(action, source), each (batch, patches): what happens to each patch embedding, and for a
    swapped one the patch whose embedding replaces it (never itself)."""
    action = np.full((len(positions), patches), UNTOUCHED, np.int64)
    source = np.tile(np.arange(patches, dtype=np.int64), (len(positions), 1))
    for row, position in enumerate(positions):
        rng = np.random.default_rng([seed, epoch, int(position), 11])
        chosen = rng.permutation(patches)[: int(patches * CORRUPTED_SHARE)]
        draw = rng.random(len(chosen))
        action[row, chosen] = np.where(
            draw < MASK_SHARE, MASKED, np.where(draw < MASK_SHARE + SWAP_SHARE, SWAPPED, KEPT)
        )
        other = rng.integers(patches - 1, size=len(chosen))
        other += other >= chosen  # any patch but itself
        source[row, chosen] = np.where(action[row, chosen] == SWAPPED, other, chosen)
    return action, source


def colour_targets(pixels: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(batch, patches) classes in [0, 512): each patch's mean colour (pixels in [0, 1]), each
    channel cut into 8 equal levels, as red * 64 + green * 8 + blue."""
    means = F.adaptive_avg_pool2d(pixels.float(), grid)  # equal patches: the image is a whole number of them
    levels = (means * 8).floor().clamp(0, 7).long()
    return (levels[:, 0] * 64 + levels[:, 1] * 8 + levels[:, 2]).flatten(1)


class MaskedPatchModel(torch.nn.Module):
    """A ViT for masked patch prediction: the patch embeddings are corrupted as `action` says (a
    learnable [mask] embedding, or the embedding of patch `source`), and a linear head predicts
    each patch's colour class from its output token. Fine-tuning keeps `vit` and drops the rest."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        if vit.reg_token is not None or vit.no_embed_class or vit.cls_token is None:
            raise ConfigError("masked patch prediction needs a ViT with a class token and no register tokens")
        self.vit = vit
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 1, vit.embed_dim))
        torch.nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = torch.nn.Linear(vit.embed_dim, COLOURS)

    def forward(self, images: torch.Tensor, action: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        x = vit.patch_embed(images)
        swapped = torch.gather(x, 1, source[..., None].expand_as(x))
        x = torch.where((action == MASKED)[..., None], self.mask_token.to(x.dtype), x)
        x = torch.where((action == SWAPPED)[..., None], swapped, x)
        x = torch.cat([vit.cls_token.expand(len(x), -1, -1).to(x.dtype), x], dim=1) + vit.pos_embed
        x = vit.norm(vit.blocks(vit.norm_pre(vit.pos_drop(x))))
        return self.head(x[:, vit.num_prefix_tokens :])
