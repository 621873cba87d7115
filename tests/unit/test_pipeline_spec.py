"""The loader's spec (pipeline/spec.py): a bad value is refused naming its field."""

from __future__ import annotations

import pytest

from vitforge.pipeline import LoaderSpec


def test_bad_spec_values_are_named():
    for kwargs, word in [({"backend": "nope"}, "backend"), ({"batch_size": 0}, "batch_size"),
                         ({"epoch_end": "wrap"}, "epoch_end"), ({"scale": (0.5, 0.1)}, "scale")]:
        with pytest.raises(ValueError, match=word):
            LoaderSpec("x", **{"batch_size": 1, **kwargs})
