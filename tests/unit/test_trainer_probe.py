"""The frozen-representation evaluators (trainer/probe.py): the closed-form ridge probe in both forms
against numpy's least squares, the regulariser's choice, few-shot and kNN accuracy on problems
whose answer is known, and the shots' draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitforge.trainer import L2_GRID, ProbeError, choose_shots, knn_top1, linear_probe
from vitforge.trainer.probe import (BIAS_FEATURE, DEFAULT_L2, choose_l2, held_out_rows, ridge_cache,
                                    times_signed_targets)


def reference_weights(x: np.ndarray, labels: np.ndarray, classes: int, l2: float) -> np.ndarray:
    """Ridge by numpy's least squares on the stacked system [X; sqrt(l2) I] W = [Y; 0], on the same
    whitened features with the bias feature."""
    mean, std = x.mean(0), x.std(0) + 1e-5
    xb = np.hstack([(x - mean) / std, np.full((len(x), 1), BIAS_FEATURE)])
    y = 2.0 * np.eye(classes)[labels] - 1.0
    stacked = np.vstack([xb, np.sqrt(l2) * np.eye(xb.shape[1])])
    targets = np.vstack([y, np.zeros((xb.shape[1], classes))])
    return np.linalg.lstsq(stacked, targets, rcond=None)[0]


@pytest.mark.parametrize("rows, dim", [(90, 24), (24, 90)], ids=["primal", "dual"])
@pytest.mark.parametrize("l2", [2.0 ** -4, 1.0, 2.0 ** 10])
def test_the_closed_form_equals_least_squares_with_the_same_regulariser(rows, dim, l2):
    rng = np.random.default_rng(rows * 1000 + dim)
    x = rng.normal(size=(rows, dim)) * rng.uniform(0.1, 5, size=dim) + rng.normal(size=dim)
    labels = rng.integers(0, 5, size=rows)
    cache = ridge_cache(torch.from_numpy(x), torch.from_numpy(labels), 5)
    assert cache.eigs.shape == (min(rows, dim + 1),)  # the form chosen: the smaller decomposition
    ours = cache.weights(l2).numpy()
    want = reference_weights(x, labels, 5, l2)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def separable(classes: int, per_class: int, dim: int, seed: int, spread: float = 0.3):
    """Gaussian clusters around random class centres: a linear probe separates them."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    labels = np.repeat(np.arange(classes), per_class)
    rng.shuffle(labels)
    x = centres[labels] + spread * rng.normal(size=(len(labels), dim))
    return torch.from_numpy(x).float(), torch.from_numpy(labels)


def test_few_shot_on_a_separable_problem_and_on_random_labels():
    classes = 10
    pool_x, pool_y = separable(classes, 40, 64, seed=1)
    test_x, test_y = separable(classes, 100, 64, seed=1)  # same centres (same seed), fresh noise
    test_x = test_x + 0.3 * torch.randn(test_x.shape, generator=torch.Generator().manual_seed(2))
    keys = np.arange(len(pool_y))
    shots = torch.from_numpy(choose_shots(pool_y.numpy(), keys, 5, seed=0, num_classes=classes))
    result = linear_probe(pool_x[shots], pool_y[shots], test_x, test_y, classes)
    assert result.top1 > 0.95 and result.train_rows == 5 * classes and result.l2 in L2_GRID
    # Labels that mean nothing, for the shots and the test rows alike: about chance.
    rng = np.random.default_rng(3)
    noise_y = torch.from_numpy(rng.integers(0, classes, len(pool_y)))
    noise_shots = torch.from_numpy(choose_shots(noise_y.numpy(), keys, 5, seed=0, num_classes=classes))
    chance = linear_probe(pool_x[noise_shots], noise_y[noise_shots], test_x,
                          torch.from_numpy(rng.permutation(test_y.numpy())), classes).top1
    assert abs(chance - 1 / classes) < 0.05  # 1,000 rows: the binomial's sd is 0.0095


def test_the_regulariser_choice_is_the_held_out_best_and_deterministic():
    x, y = separable(4, 10, 16, seed=5, spread=2.0)
    first, accuracy = choose_l2(x, y, 4)
    again, _ = choose_l2(x, y, 4)
    assert first == again and set(accuracy) == set(L2_GRID)
    best = max(accuracy.values())
    assert accuracy[first] == best and first == max(l2 for l2, a in accuracy.items() if a == best)
    # Held out: the last ceil(20%) of each class's rows, never all of them.
    held = held_out_rows(np.array([0, 0, 1, 1, 1, 1, 1, 1, 2]))
    assert held.tolist() == [False, True, False, False, False, False, True, True, False]
    # One shot per class leaves nothing to hold out: big_vision's fixed default.
    one_x, one_y = separable(4, 1, 16, seed=6)
    assert choose_l2(one_x, one_y, 4) == (DEFAULT_L2, {})


def test_shots_are_drawn_per_class_from_the_seed_and_nested():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 6, size=300)
    keys = rng.integers(-2**63, 2**63 - 1, size=300)  # each sample's key hash
    five = choose_shots(labels, keys, 5, seed=7, num_classes=6)
    assert np.array_equal(five, choose_shots(labels, keys, 5, seed=7, num_classes=6))
    assert not np.array_equal(five, choose_shots(labels, keys, 5, seed=8, num_classes=6))
    assert np.bincount(labels[five], minlength=6).tolist() == [5] * 6
    two = choose_shots(labels, keys, 2, seed=7, num_classes=6)
    for cls in range(6):  # a smaller k is a prefix of a larger one's, class by class
        assert labels[two[2 * cls:2 * cls + 2]].tolist() == [cls, cls]
        assert two[2 * cls:2 * cls + 2].tolist() == five[5 * cls:5 * cls + 2].tolist()
    # The same samples in another order (another world size's gather) are the same shots.
    shuffle = rng.permutation(300)
    assert set(keys[shuffle][choose_shots(labels[shuffle], keys[shuffle], 5, 7, 6)]) == set(keys[five])
    # A sample missing at one evaluation (it failed to read) changes nothing when it was no shot,
    # and only its own place when it was one.
    not_a_shot = next(i for i in range(300) if i not in set(five))
    kept = np.delete(np.arange(300), not_a_shot)
    assert set(keys[kept][choose_shots(labels[kept], keys[kept], 5, 7, 6)]) == set(keys[five])
    kept = np.delete(np.arange(300), five[0])
    again = set(keys[kept][choose_shots(labels[kept], keys[kept], 5, 7, 6)])
    assert len(set(keys[five]) - again) == 1 and keys[five[0]] not in again


def test_classes_with_too_few_images_are_named_unless_allowed():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 10 + [3] * 1)
    keys = np.arange(len(labels))
    with pytest.raises(ProbeError, match=r"2 class\(es\) have fewer than 5 images .*cat \(3\), dog \(1\)"):
        choose_shots(labels, keys, 5, 0, 4, class_names=["ant", "cat", "bee", "dog"])
    allowed = choose_shots(labels, keys, 5, 0, 4, allow_fewer=True)
    assert np.bincount(labels[allowed], minlength=4).tolist() == [5, 3, 5, 1]


def test_knn_on_a_separable_problem_and_its_bad_inputs():
    x, y = separable(8, 30, 32, seed=11)
    test_x, test_y = separable(8, 30, 32, seed=11)
    test_x = test_x + 0.2 * torch.randn(test_x.shape, generator=torch.Generator().manual_seed(4))
    assert knn_top1(x, y, test_x, test_y, 8, k=10) > 0.95
    # The vote is weighted by exp(similarity / 0.07): one near neighbour outweighs two far ones,
    # where a plain majority would go the other way.
    near = torch.tensor([[1.0, 0.0]])
    train_x = torch.tensor([[1.0, 0.05], [0.0, 1.0], [0.05, 1.0]])
    assert knn_top1(train_x, torch.tensor([0, 1, 1]), near, torch.tensor([0]), 2, k=3) == 1.0
    # k beyond the rows: every row votes.
    assert knn_top1(train_x, torch.tensor([0, 1, 1]), near, torch.tensor([0]), 2, k=50) == 1.0
    with pytest.raises(ProbeError, match="kNN needs"):
        knn_top1(x[:0], y[:0], test_x, test_y, 8)
    with pytest.raises(ProbeError, match="no training rows"):
        linear_probe(x[:0], y[:0], test_x, test_y, 8)


def test_the_product_with_the_signed_targets_is_the_dense_one():
    m = torch.randn(7, 4, dtype=torch.float64)
    labels = torch.tensor([2, 0, 1, 2, 2, 0, 1])
    dense = 2.0 * torch.nn.functional.one_hot(labels, 3).double() - 1.0  # one-hot rows rescaled into {-1, 1}
    torch.testing.assert_close(times_signed_targets(m, labels, 3), m.T @ dense)
