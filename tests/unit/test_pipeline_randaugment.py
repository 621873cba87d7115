"""RandAugment's plans (pipeline/randaugment.py): deterministic per position, uniform over the
operations, and each operation's magnitude. (Both backends applying each operation alike:
tests/integration/test_pipeline.py.)"""

from __future__ import annotations

import numpy as np
import pytest


def test_randaugment_plans_are_deterministic_per_position_and_uniform_over_operations():
    from vitforge.pipeline import randaugment

    positions = np.arange(20000)
    ops, negate = randaugment.plan(1, 0, positions, 2)
    assert ops.shape == negate.shape == (20000, 2)
    counts = np.bincount(ops.ravel(), minlength=len(randaugment.OPS)) / ops.size
    assert np.allclose(counts, 1 / len(randaugment.OPS), atol=0.005) and abs(negate.mean() - 0.5) < 0.01
    again = randaugment.plan(1, 0, positions[100:200], 2)
    assert np.array_equal(again[0], ops[100:200]) and np.array_equal(again[1], negate[100:200])
    assert not np.array_equal(randaugment.plan(1, 1, positions[:100], 2)[0], ops[:100])  # another epoch
    assert randaugment.magnitude("rotate", 30) == 30 and randaugment.magnitude("posterize", 0) == 8
    assert randaugment.magnitude("solarize", 30) == 0 and randaugment.magnitude("shear_x", 15) == pytest.approx(0.15)
