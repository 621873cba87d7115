"""The ViT paper's figures (Dosovitskiy et al., 2021) from a trained model, as numbers and PNGs.

- Figure 7 centre, `position_similarity`: the cosine similarity of each patch's position embedding
  with every other, one small map per position, laid out as the patch grid.
- Figure 7 left, `filter_components`: the first principal components of the patch-embedding
  filters (their RGB weights), as image tiles.
- Figure 7 right, `mean_attention_distance`: per layer and head, how far in image pixels a patch
  attends, weighted by attention (attention over the patches, renormalised without the class token).
- Figure 6, `attention_rollout` (Abnar and Zuidema, 2020): attention propagated through the layers,
  half of each layer's head-averaged attention plus half identity, from the class token to the patches.

The numbers come from plain functions over tensors; `write_figures` plots them and saves the JSON.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn.functional as F


def position_similarity(pos_embed: torch.Tensor, grid: tuple[int, int], prefix_tokens: int) -> np.ndarray:
    """(rows, cols, rows, cols): entry [r, c] is the similarity map of patch (r, c) with every patch."""
    patches = pos_embed.reshape(-1, pos_embed.shape[-1])[prefix_tokens:].float()
    unit = F.normalize(patches, dim=1)
    return (unit @ unit.T).reshape(*grid, *grid).numpy()


def filter_components(proj_weight: torch.Tensor, count: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` principal components of the patch-embedding filters (out, 3, p, p) as
    (count, p, p, 3) tiles, each scaled to [0, 1], and the share of variance each explains."""
    filters = proj_weight.reshape(proj_weight.shape[0], -1).double()
    centred = filters - filters.mean(dim=0)
    _, singular, basis = torch.linalg.svd(centred, full_matrices=False)
    count = min(count, basis.shape[0])
    tiles = basis[:count].reshape(count, *proj_weight.shape[1:]).permute(0, 2, 3, 1).numpy()
    low = tiles.min(axis=(1, 2, 3), keepdims=True)
    high = tiles.max(axis=(1, 2, 3), keepdims=True)
    variance = (singular**2 / (singular**2).sum()).numpy()
    return (tiles - low) / np.maximum(high - low, 1e-12), variance[:count]


@torch.no_grad()
def attention_maps(model, images: torch.Tensor) -> list[torch.Tensor]:
    """Every block's attention probabilities, (batch, heads, tokens, tokens), recomputed from the
    input its attention layer receives (timm computes them inside a fused kernel)."""
    inputs: list[torch.Tensor] = []
    hooks = [block.attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for block in model.blocks]
    try:
        model.eval()(images)
    finally:
        for hook in hooks:
            hook.remove()
    maps = []
    for block, x in zip(model.blocks, inputs):
        attn = block.attn
        batch, tokens, _ = x.shape
        qkv = attn.qkv(x).reshape(batch, tokens, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        maps.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1))
    return maps


def mean_attention_distance(
    attention: torch.Tensor, grid: tuple[int, int], patch_pixels: float, prefix_tokens: int
) -> np.ndarray:
    """(heads,): the attention-weighted distance in pixels between query and key patches, averaged
    over query patches and images."""
    patch_attention = attention[..., prefix_tokens:, prefix_tokens:].double()
    patch_attention = patch_attention / patch_attention.sum(dim=-1, keepdim=True).clamp(min=1e-12)
    rows, cols = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    where = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.float64)
    distance = torch.from_numpy(np.linalg.norm(where[:, None] - where[None], axis=-1) * patch_pixels)
    return (patch_attention * distance).sum(dim=-1).mean(dim=(0, 2)).numpy()


def attention_rollout(attentions: list[torch.Tensor], grid: tuple[int, int], prefix_tokens: int) -> np.ndarray:
    """(batch, rows, cols): how much each patch flows into the class token through all layers,
    scaled so each image's largest value is 1 (all zeros when nothing flows)."""
    tokens = attentions[0].shape[-1]
    identity = torch.eye(tokens, dtype=torch.float64)
    rollout = identity.expand(attentions[0].shape[0], tokens, tokens)
    for attention in attentions:
        mixed = 0.5 * attention.double().mean(dim=1) + 0.5 * identity
        rollout = (mixed / mixed.sum(dim=-1, keepdim=True)) @ rollout
    flow = rollout[:, 0, prefix_tokens:].reshape(-1, *grid)
    peak = flow.amax(dim=(1, 2), keepdim=True)
    return torch.where(peak > 0, flow / peak.clamp(min=1e-12), flow).numpy()


def compute(model, images: torch.Tensor | None) -> dict:
    """Every figure's numbers for a timm VisionTransformer (attention ones only with images)."""
    grid = tuple(model.patch_embed.grid_size)
    prefix = model.num_prefix_tokens
    out = {"grid": list(grid), "position_similarity": position_similarity(model.pos_embed.detach(), grid, prefix)}
    proj = model.patch_embed.proj.weight.detach()
    if proj.shape[1] == 3:  # a hybrid's embedding filters see ResNet features, not RGB
        out["filters"], out["filters_variance"] = filter_components(proj)
    if images is not None:
        maps = attention_maps(model, images)
        patch_pixels = images.shape[-1] / grid[1]
        out["mean_attention_distance"] = np.stack(
            [mean_attention_distance(a, grid, patch_pixels, prefix) for a in maps]
        )
        out["rollout"] = attention_rollout(maps, grid, prefix)
    return out


def write_figures(numbers: dict, images: torch.Tensor | None, out: str, mean=None, std=None) -> list[str]:
    """PNGs of `compute`'s numbers, and numbers.json; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(out, name)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    save(_position_similarity(numbers["position_similarity"]), "position_similarity.png")
    if "filters" in numbers:
        save(_embedding_filters(numbers["filters"]), "embedding_filters.png")
    if "mean_attention_distance" in numbers:
        save(_attention_distance(numbers["mean_attention_distance"]), "mean_attention_distance.png")
    if "rollout" in numbers and images is not None:
        save(_attention_rollout(numbers["rollout"], images, mean, std), "attention_rollout.png")
    path = os.path.join(out, "numbers.json")
    with open(path, "w") as f:
        json.dump({k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else v for k, v in numbers.items()}, f)
    written.append(path)
    return written


# Each figure's plot: pyplot is imported (by write_figures, after choosing its backend) only when drawn.
def _position_similarity(similarity: np.ndarray):
    import matplotlib.pyplot as plt

    rows, cols = similarity.shape[:2]
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 0.6 + 1, rows * 0.6), squeeze=False)
    for r in range(rows):
        for c in range(cols):
            shown = axes[r][c].imshow(similarity[r, c], vmin=-1, vmax=1, cmap="viridis")
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
    fig.supxlabel("Input patch column")
    fig.supylabel("Input patch row")
    fig.colorbar(shown, ax=axes, shrink=0.6, label="Cosine similarity")
    fig.suptitle("Position embedding similarity")
    return fig


def _embedding_filters(filters: np.ndarray):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 7, figsize=(7, 4), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(filters):
            ax.imshow(filters[i], interpolation="nearest")
        ax.axis("off")
    fig.suptitle("RGB embedding filters (first 28 principal components)")
    return fig


def _attention_distance(distance: np.ndarray):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4))
    for layer, heads in enumerate(distance):
        ax.scatter(np.full(len(heads), layer), heads, s=12)
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_title("Mean attention distance per head")
    return fig


def _attention_rollout(rollout: np.ndarray, images: torch.Tensor, mean, std):
    import matplotlib.pyplot as plt

    pictures = images.float() * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    pictures = pictures.clamp(0, 1).permute(0, 2, 3, 1).numpy()
    fig, axes = plt.subplots(2, len(pictures), figsize=(2 * len(pictures), 4), squeeze=False)
    for i, (picture, flow) in enumerate(zip(pictures, rollout)):
        size = picture.shape[:2]
        mask = F.interpolate(torch.from_numpy(flow)[None, None].float(), size=size, mode="bilinear")[0, 0]
        axes[0][i].imshow(picture)
        axes[1][i].imshow(picture * mask.numpy()[..., None])
        axes[0][i].axis("off")
        axes[1][i].axis("off")
    fig.suptitle("Input and attention rollout")
    return fig
