"""Profiler windows (trainer/profiling.py): no window, or one past this invocation's end, builds no
profiler. (A window profiled in a real run: tests/integration/test_diagnostics.py.)"""

from __future__ import annotations

import torch

from vitforge.core import open_store
from vitforge.trainer.profiling import profile_window


def test_no_window_builds_no_profiler(tmp_path):
    store = open_store(str(tmp_path))
    assert profile_window(None, 100, 0, torch.device("cpu"), store) is None
    assert profile_window((101, 105), 100, 0, torch.device("cpu"), store) is None  # after this invocation's end
    window = profile_window((90, 105), 100, 0, torch.device("cpu"), store)
    assert (window.next_at, window.last, window.profiler) == (89, 100, None)
