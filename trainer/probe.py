"""Evaluators of a frozen representation: few-shot and all-data linear probes in closed form, and kNN.

The ViT paper's data-scale and compute figures (section 4, Figures 3-5) plot linear few-shot
accuracy: regularised least squares from the pre-logits features of k images per class to
{-1, 1}^K targets. As big_vision's few-shot evaluator solves it: the features are whitened with
the training rows' mean and standard deviation, a constant feature of 100 stands in for the bias
(so large that the regulariser barely touches it), and one eigendecomposition serves every
regulariser of the grid:
- primal (n >= d rows): X^T X = Q diag(e) Q^T, W(l) = Q diag(1 / (e + l)) Q^T X^T Y;
- dual (n < d): X X^T = Q diag(e) Q^T, W(l) = X^T Q diag(1 / (e + l)) Q^T Y.
Each further regulariser costs one (d x m) by (m x K) product, m = min(n, d). The regulariser is
the grid's best on a held-out part of the training rows (a fifth of each class's, at least one;
ties go to the larger one); the probe is then solved again on every row with it. One shot per
class leaves nothing to hold out: those use DEFAULT_L2, big_vision's fixed default.

Cost, for n training rows, d features, K classes, m = min(n, d): the solve holds two float64
copies of X (16nd bytes: the whitened rows, then with the bias column), the eigenvectors (8m^2) and
Q^T X^T Y or Q^T Y (8mK); test rows are scored TEST_CHUNK at a time (4 TEST_CHUNK (d + K) bytes).
1,000 classes x 25 shots at ViT-H/14's width (d = 1,280): 0.48 GiB at peak above the features for
one regulariser, 0.53-0.64 GiB with the grid's held-out fit (benchmarks/fewshot_bench.py). kNN holds
KNN_CHUNK x n similarities at a time (4 KNN_CHUNK n bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BIAS_FEATURE = 100.0
L2_GRID = tuple(2.0**p for p in range(-6, 21, 2))  # log-spaced, 2^-6 ... 2^20
DEFAULT_L2 = 2.0**10
HELD_OUT_FRACTION = 0.2
TEST_CHUNK = 8192
KNN_CHUNK = 1024
KNN_T = 0.07  # DINO's temperature


class ProbeError(ValueError):
    """A probe that cannot be set up as asked (too few images of a class, no rows)."""


@dataclass(frozen=True)
class RidgeCache:
    """What one eigendecomposition leaves for solving at any regulariser: W(l) = lhs diag(1 / (eigs
    + l)) rhs; `mean`, `std` whiten new rows as the training rows were."""

    eigs: torch.Tensor  # (m,)
    lhs: torch.Tensor  # (d + 1, m)
    rhs: torch.Tensor  # (m, K)
    mean: torch.Tensor  # (d,)
    std: torch.Tensor  # (d,)

    def weights(self, l2: float) -> torch.Tensor:
        """(d + 1, K): the last row weighs the constant bias feature."""
        return (self.lhs / (self.eigs + l2)) @ self.rhs

    def scores(self, features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(rows, K) regression outputs of raw features, in float32 (scoring is most of the FLOPs, and
        an argmax needs no more); their argmax is the predicted class."""
        mean, std = self.mean.float(), self.std.float()
        return with_bias((features.float().to(mean.device) - mean) / std) @ weights.float()


def with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 1), value=BIAS_FEATURE)


def ridge_cache(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> RidgeCache:
    """Whiten, add the bias feature, and decompose in the primal or the dual form, whichever is smaller."""
    x = features.double()
    mean = x.mean(0)
    std = x.std(0, correction=0) + 1e-5
    x = with_bias(x.sub_(mean).div_(std) if x is not features else (x - mean) / std)
    labels = labels.to(x.device).long()
    n, d = x.shape
    if n >= d:
        eigs, q = torch.linalg.eigh(x.T @ x)
        return RidgeCache(eigs, q, q.T @ times_signed_targets(x, labels, num_classes), mean, std)
    eigs, q = torch.linalg.eigh(x @ x.T)
    return RidgeCache(eigs, x.T @ q, times_signed_targets(q, labels, num_classes), mean, std)


def times_signed_targets(m: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """m^T Y for the {-1, 1} targets Y of `labels`, as 2 (per-class sums of m's rows) - (all rows'
    sum): O(n d) instead of the O(n d K) of the product with Y itself."""
    sums = torch.zeros(num_classes, m.shape[1], dtype=m.dtype, device=m.device).index_add_(0, labels, m)
    return (2 * sums - m.sum(0)).T


def top1(cache: RidgeCache, weights: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of rows whose highest output is their label, scored TEST_CHUNK rows at a time."""
    if not len(labels):
        raise ProbeError("no rows to score")
    hits = 0
    for start in range(0, len(labels), TEST_CHUNK):
        chunk = features[start : start + TEST_CHUNK]
        predicted = cache.scores(chunk, weights).argmax(1)
        hits += int((predicted.cpu() == labels[start : start + TEST_CHUNK].cpu()).sum())
    return hits / len(labels)


def held_out_rows(labels: np.ndarray, fraction: float = HELD_OUT_FRACTION) -> np.ndarray:
    """Boolean mask: the last ceil(fraction x count) rows of each class with at least two rows, in
    the order given (the shots' own order, which the seed drew)."""
    mask = np.zeros(len(labels), bool)
    for cls in np.unique(labels):
        rows = np.flatnonzero(labels == cls)
        if len(rows) >= 2:
            mask[rows[len(rows) - min(len(rows) - 1, math.ceil(fraction * len(rows))) :]] = True
    return mask


def choose_l2(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, grid: tuple[float, ...] = L2_GRID
) -> tuple[float, dict[float, float]]:
    """The grid's regulariser with the best accuracy on the held-out rows when fitted on the rest
    (ties: the larger), and every one's accuracy; DEFAULT_L2 when no class has two rows."""
    held = torch.from_numpy(held_out_rows(labels.cpu().numpy()))
    if not held.any():
        return DEFAULT_L2, {}
    cache = ridge_cache(features[~held], labels[~held], num_classes)
    accuracy = {l2: top1(cache, cache.weights(l2), features[held], labels[held]) for l2 in grid}
    return max(sorted(accuracy, reverse=True), key=accuracy.__getitem__), accuracy


@dataclass(frozen=True)
class ProbeResult:
    top1: float
    l2: float  # the regulariser chosen
    train_rows: int


def linear_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    num_classes: int,
    grid: tuple[float, ...] = L2_GRID,
) -> ProbeResult:
    """Top-1 on the test rows of the ridge probe fitted on every training row, its regulariser
    chosen on a held-out part of them (few-shot and all-data probes alike)."""
    if not len(train_y):
        raise ProbeError("no training rows for the probe")
    l2, _ = choose_l2(train_x, train_y, num_classes, grid)
    cache = ridge_cache(train_x, train_y, num_classes)
    return ProbeResult(top1(cache, cache.weights(l2), test_x, test_y), l2, len(train_y))


def choose_shots(
    labels: np.ndarray,
    keys: np.ndarray,
    shots: int,
    seed: int,
    num_classes: int,
    allow_fewer: bool = False,
    class_names: list[str] | None = None,
) -> np.ndarray:
    """Row numbers of `shots` rows per class: the rows whose hash of (sample key, seed) is smallest
    in their class. A smaller k is a prefix of a larger one's (as big_vision draws them), and the
    draw depends on each sample's key alone: rows that are missing at one evaluation (a sample
    that failed to read) change no other class's shots, nor its own unless it was one. `keys`:
    int64 per row, a hash of the sample's key. Classes with fewer rows are an error naming them,
    unless `allow_fewer` (then all their rows)."""
    rank = key_rank(keys, seed)
    order = np.lexsort((rank, labels))  # by class, then by rank
    ordered = labels[order]
    starts = np.searchsorted(ordered, np.arange(num_classes))
    counts = np.searchsorted(ordered, np.arange(num_classes), side="right") - starts
    short = [(cls, int(n)) for cls, n in enumerate(counts) if n < shots]
    if short and not allow_fewer:
        named = ", ".join(f"{class_names[c] if class_names else c} ({n})" for c, n in short[:10])
        more = f" and {len(short) - 10} more" if len(short) > 10 else ""
        raise ProbeError(
            f"{len(short)} class(es) have fewer than {shots} images to draw shots from: {named}{more} "
            "(set eval.allow_fewer to use what they have)"
        )
    return np.concatenate(
        [order[start : start + min(shots, n)] for start, n in zip(starts, counts)] or [np.empty(0, np.int64)]
    )


def key_rank(keys: np.ndarray, seed: int) -> np.ndarray:
    """A uint64 per key, as if drawn at random for this seed (splitmix64's finaliser of key ^ seed)."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.int64).view(np.uint64) ^ np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def knn_top1(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    num_classes: int,
    k: int = 20,
) -> float:
    """Top-1 of a k-nearest-neighbour vote by cosine similarity, as DINO's evaluator weighs it: each
    of a test row's k most similar training rows votes for its class with exp(similarity / KNN_T)."""
    if not len(train_y) or not len(test_y):
        raise ProbeError("kNN needs training and test rows")
    k = min(k, len(train_y))
    train = torch.nn.functional.normalize(train_x.float(), dim=1)
    labels = train_y.to(train.device).long()
    hits = 0
    for start in range(0, len(test_y), KNN_CHUNK):
        test = torch.nn.functional.normalize(test_x[start : start + KNN_CHUNK].float().to(train.device), dim=1)
        similarity, nearest = (test @ train.T).topk(k, dim=1)
        votes = torch.zeros(len(test), num_classes, device=train.device)
        votes.scatter_add_(1, labels[nearest], (similarity / KNN_T).exp())
        hits += int((votes.argmax(1).cpu() == test_y[start : start + KNN_CHUNK].cpu()).sum())
    return hits / len(test_y)
