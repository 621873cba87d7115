"""The paper's figures (trainer/figures.py): known-answer inputs for each computation: position
similarity, mean attention distance, attention rollout and the filters' principal components."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vitforge.trainer.figures import attention_rollout, filter_components, mean_attention_distance, position_similarity


def sinusoids_2d(rows: int, cols: int, frequencies: int) -> torch.Tensor:
    omega = 1.0 / 10000 ** (torch.arange(frequencies) / frequencies)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    parts = [f(axis.reshape(-1, 1).double() * omega) for axis in (r, c) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, dim=1)


def test_2d_sinusoid_position_embeddings_give_the_analytic_similarity():
    """e(r,c).e(r',c') = sum_k cos(w_k (r-r')) + sum_k cos(w_k (c-c')), |e|^2 = 2K."""
    rows, cols, k = 5, 7, 16
    cls = torch.randn(1, 4 * k).double()
    embed = torch.cat([cls, sinusoids_2d(rows, cols, k)])[None]
    similarity = position_similarity(embed, (rows, cols), prefix_tokens=1)
    omega = 1.0 / 10000 ** (np.arange(k) / k)
    for r, c, r2, c2 in [(0, 0, 0, 0), (1, 2, 3, 6), (4, 6, 0, 0), (2, 3, 2, 4)]:
        expected = (np.cos(omega * (r - r2)).sum() + np.cos(omega * (c - c2)).sum()) / (2 * k)
        assert similarity[r, c, r2, c2] == pytest.approx(expected, abs=1e-6)
    assert np.allclose(np.einsum("ijij->ij", similarity), 1)
    for r in range(rows):  # each map peaks at its own patch
        for c in range(cols):
            assert np.unravel_index(similarity[r, c].argmax(), (rows, cols)) == (r, c)


def test_uniform_attention_over_a_grid_has_the_analytic_mean_distance():
    heads, tokens = 3, 1 + 4
    uniform = torch.full((2, heads, tokens, tokens), 1.0 / tokens)  # the class token's share is dropped
    distance = mean_attention_distance(uniform, (2, 2), patch_pixels=16, prefix_tokens=1)
    assert np.allclose(distance, 16 * (0 + 1 + 1 + math.sqrt(2)) / 4)
    own = torch.eye(tokens).expand(2, heads, tokens, tokens)
    assert np.allclose(mean_attention_distance(own, (2, 2), 16, 1), 0)
    grid = (3, 4)
    uniform = torch.full((1, 1, 13, 13), 1.0 / 13)
    where = [(r, c) for r in range(3) for c in range(4)]
    brute = np.mean([math.dist(a, b) for a in where for b in where])
    assert mean_attention_distance(uniform, grid, 1, 1)[0] == pytest.approx(brute)


def test_rollout_of_identity_attention_is_uniform_and_of_attention_to_one_patch_points_there():
    tokens, grid = 1 + 9, (3, 3)
    identity = [torch.eye(tokens).expand(2, 4, tokens, tokens) for _ in range(3)]
    flat = attention_rollout(identity, grid, 1)
    assert flat.shape == (2, 3, 3) and np.all(flat == flat[0, 0, 0])
    looking = torch.zeros(1, 1, tokens, tokens)
    looking[..., :, 1 + 5] = 1.0  # everything attends to patch 5, i.e. row 1, column 2
    focused = attention_rollout([looking, looking], grid, 1)[0]
    assert np.unravel_index(focused.argmax(), grid) == (1, 2) and focused.max() == 1.0


def test_filter_components_find_the_patterns_the_filters_mix():
    generator = torch.Generator().manual_seed(0)
    patterns = torch.linalg.qr(torch.randn(3 * 4 * 4, 2, generator=generator, dtype=torch.float64))[0].T
    mixes = torch.randn(50, 2, generator=generator, dtype=torch.float64) * torch.tensor([5.0, 1.0],
                                                                                         dtype=torch.float64)
    filters = (mixes @ patterns).reshape(50, 3, 4, 4)
    tiles, variance = filter_components(filters, count=28)
    assert tiles.shape == (28, 4, 4, 3) and tiles.min() >= 0 and tiles.max() <= 1
    assert variance[:2].sum() == pytest.approx(1.0) and variance[0] > variance[1]
    first = torch.linalg.svd(filters.reshape(50, -1) - filters.reshape(50, -1).mean(0), full_matrices=False)[2][0]
    assert abs(torch.dot(first, patterns[0]).item()) > 0.99  # the dominant pattern comes first
