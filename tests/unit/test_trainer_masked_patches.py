"""Masked patch prediction (trainer/masked_patches.py): the corruption's proportions and determinism,
colour targets against a hand computation, and the mask embedding and swapped patches the model sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitforge.trainer.masked_patches import KEPT, MASKED, SWAPPED, UNTOUCHED, colour_targets, corruption


def test_half_the_patches_are_corrupted_80_10_10_deterministically():
    positions = np.arange(4000)
    action, source = corruption(seed=3, epoch=1, positions=positions, patches=196)
    assert ((action != UNTOUCHED).sum(axis=1) == 98).all()  # exactly half of every image
    corrupted = action[action != UNTOUCHED]
    shares = [np.mean(corrupted == kind) for kind in (MASKED, SWAPPED, KEPT)]
    assert shares == pytest.approx([0.8, 0.1, 0.1], abs=0.005)  # 392,000 corrupted patches
    patch = np.arange(196)
    assert (source[action == SWAPPED] != np.broadcast_to(patch, action.shape)[action == SWAPPED]).all()
    assert (source[action != SWAPPED] == np.broadcast_to(patch, action.shape)[action != SWAPPED]).all()
    again, same = corruption(3, 1, positions[:10], 196)
    assert np.array_equal(again, action[:10]) and np.array_equal(same, source[:10])
    assert not np.array_equal(corruption(3, 2, positions[:10], 196)[0], action[:10])  # another epoch
    assert not np.array_equal(corruption(4, 1, positions[:10], 196)[0], action[:10])  # another seed


def test_colour_targets_equal_a_hand_computation():
    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 8, 12, generator=generator)
    targets = colour_targets(pixels, (2, 3))
    for b in range(2):
        for r in range(2):
            for c in range(3):
                mean = pixels[b, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4].mean(dim=(1, 2))
                red, green, blue = (min(int(v * 8), 7) for v in mean.tolist())
                assert targets[b, r * 3 + c].item() == red * 64 + green * 8 + blue
    white, black = torch.ones(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)
    assert colour_targets(white, (1, 1)).item() == 511 and colour_targets(black, (1, 1)).item() == 0


def test_the_model_sees_the_mask_embedding_and_swapped_patches():
    from vitforge.trainer import build_model

    model = build_model("vit_tiny_cpu", 10, 32, objective="masked_patch_prediction").eval()
    images = torch.randn(2, 3, 32, 32)
    plain = torch.zeros(2, 16, dtype=torch.long)
    identity = torch.arange(16).expand(2, 16)
    out = model(images, plain, identity)
    assert out.shape == (2, 16, 512)
    masked = plain.clone()
    masked[0, 3] = MASKED
    assert not torch.allclose(model(images, masked, identity)[0], out[0])
    assert torch.allclose(model(images, masked, identity)[1], out[1])
    kept = plain.clone()
    kept[0, 3] = KEPT  # corrupted but left as it was: the same input
    assert torch.equal(model(images, kept, identity), out)
