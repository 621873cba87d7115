"""The epoch's sample order and its split over ranks: pure functions of (seed, epoch, sizes).

One global order per epoch: shards permuted, samples permuted within each shard, then mixed
within windows of `shuffle_window` positions (a shuffle buffer without the buffer). Ranks take
whole batches from it in turn: batch b of rank r is positions [(b*W + r)*B, (b*W + r + 1)*B).
So after k steps the ranks together have consumed exactly the first k*W*B positions, whatever W
and B are, which is what makes resuming exact even at another world size or batch size. With
gradient accumulation an optimizer step is A consecutive batches, i.e. one contiguous global batch
of W*B*A positions, and epochs end on whole optimizer steps.

Hashing instead of a seeded generator keeps the order identical across numpy versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(*parts) -> np.ndarray:
    """splitmix64 of the combined parts, vectorised: a fixed, portable pseudo-random hash."""
    with np.errstate(over="ignore"):
        x = np.zeros(np.broadcast(*[np.asarray(p) for p in parts]).shape, dtype=np.uint64)
        for p in parts:
            x = (x ^ np.asarray(p, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            x = x + np.uint64(0x632BE59BD9B4E5B3)
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
        return x & _MASK


def epoch_order(shard_of_sample: np.ndarray, seed: int, epoch: int, window: int) -> np.ndarray:
    """Sample ids in this epoch's order."""
    n = len(shard_of_sample)
    ids = np.arange(n, dtype=np.uint64)
    shard_key = mix(seed, epoch, 1, np.arange(shard_of_sample.max() + 1, dtype=np.uint64))
    order = np.lexsort((mix(seed, epoch, 2, ids), shard_key[shard_of_sample]))
    if window > 1:
        positions = np.arange(n, dtype=np.uint64)
        order = order[np.lexsort((mix(seed, epoch, 3, positions), positions // np.uint64(window)))]
    return order


def subset_ids(num_samples: int, size: float | int, seed: int) -> np.ndarray:
    """The samples of a deterministic subset, ascending: a fraction (float, 0 < size <= 1) or a
    count (int) of the first samples of one fixed ranking of all of them per seed. Every smaller
    subset is therefore inside every larger one (10% within 30%), as a data-scale study needs."""
    count = round(size * num_samples) if isinstance(size, float) else size
    if not 1 <= count <= num_samples:
        raise ValueError(f"subset {size!r} selects {count} of {num_samples} samples; give a fraction in (0, 1] "
                         f"or a count from 1 to {num_samples}")
    ranking = np.argsort(mix(seed, 4, np.arange(num_samples, dtype=np.uint64)), kind="stable")
    return np.sort(ranking[:count])


@dataclass(frozen=True)
class RankSlice:
    """The batches one rank draws from an epoch that started `consumed` positions in."""

    num_samples: int
    consumed: int
    rank: int
    world_size: int
    batch_size: int
    epoch_end: str
    accumulation: int = 1  # micro-batches per optimizer step: epochs end on whole optimizer steps

    @property
    def num_batches(self) -> int:
        remaining = max(self.num_samples - self.consumed, 0)
        per_step = self.world_size * self.batch_size * self.accumulation
        steps = -(-remaining // per_step) if self.epoch_end == "pad" else remaining // per_step
        return steps * self.accumulation

    def positions(self, batch: int) -> np.ndarray:
        """Epoch positions of one batch; positions past the end wrap to the start (padding)."""
        first = self.consumed + (batch * self.world_size + self.rank) * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)
