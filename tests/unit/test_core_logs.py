"""The process's rank as the logs read it (core/logs.py)."""

from __future__ import annotations

from vitforge.core import process_rank


def test_process_rank_never_fails_logging(monkeypatch):
    """A bad variable is reported by what reads the place (the trainer, the lease); the logs still work."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert process_rank() == 3
    monkeypatch.setenv("RANK", "three")
    assert process_rank() == 0
