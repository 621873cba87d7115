"""Starting the tests' real services: a service that cannot start fails the test, naming why."""

from __future__ import annotations

import pytest


def start_or_fail(start, tmp_path_factory, name: str):
    """`start(folder)` (one of vitforge.testing's starters) in a fresh temporary folder `name`; a
    RuntimeError from it (a missing binary, a port that never opened) fails the test with its
    message: never a skip, so a missing service cannot turn the suite green."""
    try:
        return start(str(tmp_path_factory.mktemp(name)))
    except RuntimeError as e:
        pytest.fail(str(e))
